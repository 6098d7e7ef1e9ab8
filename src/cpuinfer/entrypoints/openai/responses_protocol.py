"""The request body of POST /v1/responses (OpenAI's Responses API) and the chat request it means: input items
-> messages, instructions -> a system message, text.format -> response_format, function tools -> tools,
reasoning.effort -> reasoning_effort. Nothing is stored, so previous_response_id is refused."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from cpuinfer.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIModel, PredictionContent
from cpuinfer.sampling_params import INT32_MAX, MAX_TEMPERATURE


class InputText(OpenAIModel):
    """A text part of an input message (output_text: an earlier answer sent back)."""

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list | None = None  # of an output_text sent back; carries nothing here


class InputMessage(OpenAIModel):
    """A message of the conversation."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        """The content as one string."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(OpenAIModel):
    """An earlier function call of the model, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(OpenAIModel):
    """The result of a function call."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class FunctionTool(OpenAIModel):
    """A function the model may call (the Responses API's flat spelling)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunctionChoice(OpenAIModel):
    """tool_choice naming one function."""

    type: Literal["function"]
    name: str


class TextFormat(OpenAIModel):
    """text.format: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(OpenAIModel):
    """`text`: the output's format."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # refused unless medium: it would change the text

    @model_validator(mode="after")
    def _check(self):
        if self.verbosity not in (None, "medium"):
            raise ValueError("text.verbosity is not supported by this server; remove it")
        return self


class Reasoning(OpenAIModel):
    """`reasoning`: the effort is passed to the chat template, as reasoning_effort on the chat route."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[Annotated[InputMessage | FunctionCallItem | FunctionCallOutputItem, Field()]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: Reasoning | None = None
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop input: refused
    include: Annotated[list[str], Field(max_length=0)] | None = None
    # Accepted and logged as on the chat route (ignored_fields.py): they do not change the output.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prediction: PredictionContent | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.previous_response_id is not None:
            raise ValueError(
                "previous_response_id is not supported: this server stores no responses; send the whole "
                "conversation in input"
            )
        return self

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion request this one means."""
        messages: list[dict] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                    messages[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
        }
        for name in ("store", "metadata", "service_tier", "user", "safety_identifier", "prompt_cache_key"):
            if name in self.model_fields_set:
                body[name] = getattr(self, name)
        if self.prediction is not None:
            body["prediction"] = self.prediction
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name or "response", "schema": fmt.schema_ or {}, "strict": fmt.strict}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        return ChatCompletionRequest.model_validate(body)
