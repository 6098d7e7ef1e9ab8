"""What a tool-call parser returns, and the JSON scanning the parsers share.

A parser reads the whole text generated so far and says which part is content and which calls it holds,
each call's arguments as the raw JSON text the model wrote. Raw text, not re-serialized JSON: while the
model is still writing, what was seen is a prefix of what will be seen, so a stream can send each call's
arguments piece by piece and the pieces add up to the final (non-streaming) arguments exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

WS = " \t\r\n"
# Deeper JSON is malformed here: json.loads recurses per level (RecursionError near 1000), and no function's
# arguments need more. A call nested deeper is returned as text, as vLLM does with calls it cannot decode.
MAX_DEPTH = 128


def loads(text: str):
    """json.loads, with a value nested too deeply for it as the ValueError every other malformed text is."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


@dataclass
class ParsedCall:
    """One call: its name (None until complete), its raw arguments text so far, and whether it is complete."""

    name: str | None
    arguments: str
    complete: bool


@dataclass
class ParsedOutput:
    """The content (text outside calls) and the calls of a generated text."""

    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser:
    """Splits generated text into content and tool calls (`final`: the text is complete)."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        """Content and calls of `text`; when not final, possibly incomplete (the last call, a held-back tag)."""
        raise NotImplementedError


def skip_value(s: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at s[i] (after whitespace); None if the text stops inside it.
    Raises ValueError on text that cannot be JSON."""
    n = len(s)
    while i < n and s[i] in WS:
        i += 1
    if i >= n:
        return None
    c = s[i]
    if c == '"':
        i += 1
        while i < n:
            if s[i] == "\\":
                i += 2
                continue
            if s[i] == '"':
                return i + 1
            i += 1
        return None
    if c in "{[":
        depth, in_str = 0, False
        while i < n:
            ch = s[i]
            if in_str:
                if ch == "\\":
                    i += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
                if depth > MAX_DEPTH:
                    raise ValueError(f"JSON nested more than {MAX_DEPTH} levels deep")
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    j = i
    while j < n and s[j] not in WS + ",}]":
        j += 1
    if j == n:
        return None  # a number or literal may go on
    loads(s[i:j])  # ValueError if it is not a JSON literal
    return j


@dataclass
class ScannedObject:
    """A JSON object's top-level fields as raw (start, end) spans; end is None for a value still being written."""

    fields: dict[str, tuple[int, int | None]]
    end: int | None  # after the closing brace; None while incomplete


def scan_object(s: str, i: int) -> ScannedObject:
    """The fields of the object starting at s[i] (after whitespace), complete or not; ValueError if malformed."""
    n = len(s)
    while i < n and s[i] in WS:
        i += 1
    fields: dict[str, tuple[int, int | None]] = {}
    if i >= n:
        return ScannedObject(fields, None)
    if s[i] != "{":
        raise ValueError(f"expected an object at {i}")
    i += 1
    while True:
        while i < n and s[i] in WS + ",":
            i += 1
        if i >= n:
            return ScannedObject(fields, None)
        if s[i] == "}":
            return ScannedObject(fields, i + 1)
        key_end = skip_value(s, i)
        if key_end is None:
            return ScannedObject(fields, None)
        key = loads(s[i:key_end])
        if not isinstance(key, str):
            raise ValueError("object key is not a string")
        i = key_end
        while i < n and s[i] in WS:
            i += 1
        if i >= n:
            return ScannedObject(fields, None)
        if s[i] != ":":
            raise ValueError(f"expected ':' at {i}")
        i += 1
        while i < n and s[i] in WS:
            i += 1
        end = skip_value(s, i)
        fields[key] = (i, end)
        if end is None:
            return ScannedObject(fields, None)
        i = end


def call_from_object(s: str, obj: ScannedObject, args_keys: tuple[str, ...]) -> ParsedCall | None:
    """The call an object {"name": ..., <args key>: {...}} describes; None if it is complete but not a call."""
    name = None
    span = obj.fields.get("name")
    if span is not None and span[1] is not None:
        value = loads(s[span[0] : span[1]])
        name = value if isinstance(value, str) else None
    args_span = next((obj.fields[k] for k in args_keys if k in obj.fields), None)
    if args_span is None:
        arguments = "{}" if obj.end is not None else ""
    else:
        start, end = args_span
        raw = s[start:end] if end is not None else s[start:].rstrip(WS)
        if end is not None and raw.startswith('"'):
            raw = loads(raw)  # arguments written as a JSON string holding the object
        elif end is None and raw.startswith('"'):
            raw = ""  # sent whole once complete: its escaped form is not a prefix of the decoded one
        arguments = raw
    if obj.end is not None and name is None:
        return None
    return ParsedCall(name, arguments, obj.end is not None)


def scan_calls(s: str, i: int, separators: str, args_keys: tuple[str, ...]) -> tuple[list[ParsedCall], int | None]:
    """Calls written as objects one after another (separated by any of `separators`) from s[i]; returns the calls
    and where the last complete one ends. ValueError if the text is not such a sequence."""
    calls: list[ParsedCall] = []
    last_end = None
    n = len(s)
    while True:
        while i < n and s[i] in WS + separators:
            i += 1
        if i >= n or s[i] != "{":
            return calls, last_end
        obj = scan_object(s, i)
        call = call_from_object(s, obj, args_keys)
        if call is None:
            raise ValueError("an object without a function name")
        calls.append(call)
        if obj.end is None:
            return calls, None
        i = last_end = obj.end
