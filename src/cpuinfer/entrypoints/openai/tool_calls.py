"""Tool calling on the chat route: which constraint a tool_choice imposes, which parser reads the reply, and the
stream of `delta.tool_calls` pieces that add up to the final calls.

tool_choice "required" and a named function are enforced with a grammar (vLLM's way): "required" makes the model
write a JSON array of {"name", "parameters"} objects, one per call (one only without parallel_tool_calls); a named
function makes it write that function's arguments. "auto" lets the model write freely and the server's
--tool-call-parser finds the calls in the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cpuinfer.entrypoints.openai.errors import APIError
from cpuinfer.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    NamedToolChoice,
    ToolCall,
    ToolCallFunction,
    random_id,
)
from cpuinfer.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedCall, ParsedOutput, ToolParser
from cpuinfer.entrypoints.openai.tool_parsers.base import WS, scan_calls
from cpuinfer.sampling_params import StructuredOutputsParams


class RequiredCallsParser(ToolParser):
    """The reply of tool_choice "required": a JSON array of {"name", "parameters"} objects."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        """The calls of the array (the grammar guarantees its shape)."""
        body = text.lstrip(WS)
        if not body.startswith("["):
            return ParsedOutput(text if final else "")
        calls, _ = scan_calls(body, 1, ",", ("parameters", "arguments"))
        return ParsedOutput("", calls)


class NamedCallParser(ToolParser):
    """The reply of a named tool_choice: the whole text is the arguments of that function."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        """One call whose arguments are the text."""
        return ParsedOutput("", [ParsedCall(self.name, text.strip(WS) if final else text.lstrip(WS), final)])


def _parameters(fn) -> dict:
    return fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}


def tool_constraint(req: ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The grammar a forcing tool_choice imposes (None for none / auto / no tools)."""
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        fn = next(t.function for t in req.tools if t.function.name == choice.function.name)
        return StructuredOutputsParams(json=_parameters(fn))
    if choice == "required":
        one_of = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t.function.name]},
                    "parameters": _parameters(t.function),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in req.tools
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": one_of}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)
    return None


def tool_parser_for(req: ChatCompletionRequest, auto_parser: str | None) -> ToolParser | None:
    """The parser that reads this request's reply, or None when the reply is plain content; a 400 when tool_choice
    is "auto" but the server was not started with --enable-auto-tool-choice --tool-call-parser."""
    if req.tool_choice not in (None, "none") and not req.tools:
        raise APIError("tool_choice needs tools", 400, "tool_choice")
    if not req.tools or req.tool_choice == "none":
        return None
    if isinstance(req.tool_choice, NamedToolChoice):
        names = [t.function.name for t in req.tools]
        if req.tool_choice.function.name not in names:
            raise APIError(
                f"tool_choice names the function {req.tool_choice.function.name!r}, which is not in "
                f"tools ({', '.join(names)})",
                400,
                "tool_choice",
            )
        return NamedCallParser(req.tool_choice.function.name)
    if req.tool_choice == "required":
        return RequiredCallsParser()
    if auto_parser is None:
        raise APIError(
            '"auto" tool choice needs the server started with --enable-auto-tool-choice and '
            '--tool-call-parser; or set tool_choice to "required", "none" or a named function.',
            400,
            "tool_choice",
        )
    return TOOL_PARSERS[auto_parser]()


def tool_calls_of(parsed: ParsedOutput, ids: list[str]) -> list[ToolCall]:
    """The complete calls as OpenAI tool_calls (ids given, so a stream and its final message agree)."""
    return [
        ToolCall(id=ids[i], function=ToolCallFunction(name=c.name, arguments=c.arguments))
        for i, c in enumerate(parsed.calls)
        if c.complete and c.name
    ]


@dataclass
class ToolCallStream:
    """Turns the growing reply into content deltas and `delta.tool_calls` pieces (each sent once)."""

    parser: ToolParser
    text: str = ""
    sent_content: int = 0
    ids: list[str] = field(default_factory=list)
    sent_args: list[int] = field(default_factory=list)

    def feed(self, delta: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        """Add the newly generated text; returns (new content, new tool-call pieces)."""
        self.text += delta
        parsed = self.parser.parse(self.text, final)
        content = parsed.content[self.sent_content :]
        self.sent_content = max(self.sent_content, len(parsed.content))
        pieces = []
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break  # its name is not complete yet; later calls cannot be either
            if i == len(self.ids):
                self.ids.append(random_id("chatcmpl-tool"))
                self.sent_args.append(0)
                pieces.append(
                    DeltaToolCall(
                        index=i,
                        id=self.ids[i],
                        type="function",
                        function=DeltaFunctionCall(name=call.name, arguments=""),
                    )
                )
            new = call.arguments[self.sent_args[i] :]
            if new:
                self.sent_args[i] = len(call.arguments)
                if pieces and pieces[-1].index == i:
                    pieces[-1].function.arguments += new
                else:
                    pieces.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=new)))
        return content, pieces

    def final_calls(self) -> tuple[str, list[ToolCall]]:
        """(content, complete calls) of the whole reply."""
        parsed = self.parser.parse(self.text, True)
        while len(self.ids) < len(parsed.calls):
            self.ids.append(random_id("chatcmpl-tool"))
        return parsed.content, tool_calls_of(parsed, self.ids)
