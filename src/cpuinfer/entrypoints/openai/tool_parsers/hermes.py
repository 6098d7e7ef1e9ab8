"""Hermes-style calls (Qwen 2.5/3, Hermes, SmolLM3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
any number of them, with free text around."""

from __future__ import annotations

from cpuinfer.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolParser, call_from_object, scan_object

START, END = "<tool_call>", "</tool_call>"


def _held_back(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag` (not content yet)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class HermesToolParser(ToolParser):
    """`<tool_call>` JSON `</tool_call>` blocks; a block that is not a valid call stays in the content."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        """Content and calls of `text`."""
        out = ParsedOutput("")
        pos = 0
        while True:
            i = text.find(START, pos)
            if i < 0:
                rest = text[pos:]
                out.content += rest if final else rest[: len(rest) - _held_back(rest, START)]
                return out
            out.content += text[pos:i]
            body_start = i + len(START)
            j = text.find(END, body_start)
            body = text[body_start:j] if j >= 0 else text[body_start:]
            try:
                obj = scan_object(body, 0)
                call = call_from_object(body, obj, ("arguments", "parameters"))
            except ValueError:
                call = None
            if j < 0:  # still being written
                if call is not None and not final:
                    call.complete = False
                    out.calls.append(call)
                elif final:
                    out.content += text[i:]
                return out
            if call is None or not call.complete:
                out.content += text[i : j + len(END)]  # malformed: keep the text, report no call
            else:
                out.calls.append(call)
            pos = j + len(END)
