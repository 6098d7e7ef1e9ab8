"""Llama 3.x JSON calls: the reply is `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`),
several separated by `;`. A reply that does not start with a call is plain content."""

from __future__ import annotations

from cpuinfer.entrypoints.openai.tool_parsers.base import ParsedOutput, ToolParser, scan_calls

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """A reply made of JSON calls; any other reply (or one whose JSON is malformed) is content."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        """Content and calls of `text`."""
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :]
        elif not final and PYTHON_TAG.startswith(body) and body:
            return ParsedOutput("")  # may be the tag's start
        if not body.lstrip().startswith("{"):
            return ParsedOutput(text if (final or body.strip()) else "")
        try:
            calls, end = scan_calls(body, 0, ";", ("parameters", "arguments"))
        except ValueError:
            return ParsedOutput(text if final else "")
        if final and (end is None or body[end:].strip(" \t\r\n;")):
            return ParsedOutput(text)  # not only calls: the reply is content
        return ParsedOutput("", calls)
