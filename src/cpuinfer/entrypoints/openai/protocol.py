"""Request and response bodies of the OpenAI API as vLLM serves it (pydantic).

Field names, defaults and limits follow OpenAI's API plus vLLM's sampling
extras, so clients written for either work unchanged. A field this server does
not implement is refused with a 400 naming it (never silently ignored). Bounds that depend on the loaded model
(context length, vocabulary) are checked later, in the serving layer.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from cpuinfer.entrypoints.openai.ignored_fields import log_ignored

# The same bounds as SamplingParams (one table, in cpuinfer.sampling_params): a value this schema
# accepts is never refused later, after the response has started. Limits that depend on the engine
# (vocabulary, context, --max-logprobs, stop-list sizes) are the engine's request validation's.
from cpuinfer.sampling_params import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    PENALTY_RANGE,
)

PENALTY = Field(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], allow_inf_nan=False)


def random_id(prefix: str) -> str:
    """A fresh OpenAI-style object id such as cmpl-<hex>."""
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    """Base of request bodies: a field we do not implement is an error naming it, not silently dropped."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StructuredOutputsField(OpenAIModel):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: str | dict | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class JsonSchemaFormat(OpenAIModel):
    """`response_format.json_schema`: a named schema (strict or not: the output always follows it)."""

    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """`response_format`: text, any JSON object, or JSON following a schema.

    The schema comes in OpenAI's `json_schema: {name, schema}` or, as older clients (instructor's
    JSON_SCHEMA mode) send it, as a top-level `schema`; both mean the same."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict | None = Field(None, alias="schema")

    @model_validator(mode="after")
    def _check_schema(self):
        if self.schema_ is not None:
            if self.type != "json_schema":
                raise ValueError(f"response_format.schema needs type json_schema, not {self.type}")
            if self.json_schema is not None:
                raise ValueError("response_format: give the schema once, in json_schema.schema or in schema")
            self.json_schema = JsonSchemaFormat(name="response", schema=self.schema_)
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema object")
        return self


class TextContentPart(OpenAIModel):
    """A text part of a message's content list."""

    type: Literal["text"]
    text: str


class PredictionContent(OpenAIModel):
    """`prediction`: OpenAI's predicted output, text the reply is expected to repeat largely (a file being
    edited). It feeds speculative decoding's proposer; the reply is what it would be without it."""

    type: Literal["content"]
    content: str | list[TextContentPart]

    @property
    def text(self) -> str:
        """The predicted text."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(OpenAIModel):
    """`stream_options`: include a final usage chunk (and per-chunk usage, vLLM's extension)."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class SamplingFields(OpenAIModel):
    """Sampling fields shared by completions and chat (OpenAI's plus vLLM's extras)."""

    ROUTE: ClassVar[str] = "request"
    model: str | None = None
    n: Annotated[int, Field(strict=True, ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    presence_penalty: Annotated[float, PENALTY] | None = 0.0
    frequency_penalty: Annotated[float, PENALTY] | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)] | None = None
    seed: Annotated[int, Field(strict=True, ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]] | None = None
    max_tokens: Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)] | None = None
    min_tokens: Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)] = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Accepted, logged once and ignored: they do not change the output (ignored_fields.py).
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # Implemented: prediction feeds the speculative proposer (spec_decode; the reply is unchanged), logit_bias
    # the sampler.
    prediction: PredictionContent | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]] | None = None
    # Constrained output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is not None:
            if len(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed")
            bad = [k for k in bias if not k.strip().isdigit()]
            if bad:
                raise ValueError(f'logit_bias keys must be token ids (e.g. "1234"); got {bad[0]!r}')
        return bias

    def logit_bias_ids(self) -> dict[int, float] | None:
        """logit_bias with its keys as token ids (JSON object keys are strings)."""
        return {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None

    @model_validator(mode="after")
    def _check_cross_fields(self):
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        log_ignored(self.model_fields_set, self.ROUTE)
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return self


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    ROUTE: ClassVar[str] = "/v1/completions"
    prompt: (
        str
        | list[str]
        | list[Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]]
        | list[list[Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]]]
    )
    max_tokens: Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)] | None = 16
    echo: bool = False
    logprobs: Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)] | None = None  # at most --max-logprobs
    best_of: Annotated[int, Field(strict=True, ge=1, le=MAX_N)] | None = None
    # vLLM's: the top-k logprobs of every prompt token, in each choice's prompt_logprobs (at most --max-logprobs)
    prompt_logprobs: Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)] | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_completion(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of different from n is not supported; omit best_of")
        if self.suffix:
            raise ValueError("suffix is not supported by this server; remove it")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be an empty list")
        return self


class ToolCallFunction(OpenAIModel):
    """The function a tool call names and its arguments (a JSON text)."""

    name: str
    arguments: str


class ToolCall(OpenAIModel):
    """One tool call of an assistant message."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: ToolCallFunction


class FunctionDefinition(OpenAIModel):
    """A function the model may call: its name, description and JSON-schema parameters."""

    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ChatTool(OpenAIModel):
    """An entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    """The function a named tool_choice forces."""

    name: str


class NamedToolChoice(OpenAIModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"]
    function: NamedFunction


class ChatMessage(OpenAIModel):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # Fields of a response message that clients echo back as they got them; only empty values carry nothing.
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: Annotated[list, Field(max_length=0)] | None = None

    def template_dict(self) -> dict:
        """The message as chat templates read it (transformers' shape: tool_calls arguments as objects)."""
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    ROUTE: ClassVar[str] = "/v1/chat/completions"
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)] | None = None  # at most --max-logprobs
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    chat_template: str | None = None  # vLLM's: a Jinja template used instead of the model's
    # vLLM's: the top-k logprobs of every token of the rendered prompt, in the response (not with stream)
    prompt_logprobs: Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template (vLLM's)
    # Passed to the chat template as the variable reasoning_effort (as vLLM does); templates that read it
    # (gpt-oss, some Qwen / SmolLM3 variants) change their system prompt, the others ignore it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available with stream: true (as in vLLM)")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be from the assistant")
        if self.reasoning_effort is not None:
            self.chat_template_kwargs = {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}
        return self

    def output_limit(self) -> int | None:
        """max_completion_tokens (OpenAI's newer name) wins over max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def _arguments(text: str) -> Any:
    """Tool-call arguments as an object for the template (as transformers passes them), or the text if not JSON."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply for json to decode
        return text


class TokenizeCompletionRequest(OpenAIModel):
    """POST /tokenize with a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(OpenAIModel):
    """POST /tokenize with chat messages (the chat template is applied)."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class TokenizeResponse(BaseModel):
    """Tokens of the prompt and the model's context length."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    """POST /detokenize."""

    model: str | None = None
    tokens: list[Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]]


class DetokenizeResponse(BaseModel):
    """The text of the tokens."""

    prompt: str


# ---- responses ----------------------------------------------------------------------------------


class CompletionTokensDetails(BaseModel):
    """OpenAI's breakdown of completion tokens (here: a request with a prediction's)."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of one request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    completion_tokens_details: CompletionTokensDetails | None = None  # with a prediction only

    @model_serializer(mode="wrap")
    def _omit_empty_details(self, handler):
        out = handler(self)
        if out.get("completion_tokens_details") is None:
            out.pop("completion_tokens_details", None)
        return out


class CompletionLogProbs(BaseModel):
    """Legacy completions logprobs: parallel lists per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of prompt_logprobs: one candidate token's logprob, rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    """One choice of a completion (or one streamed piece of it)."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # with the request's (vLLM's)


class CompletionResponse(BaseModel):
    """Body of a non-streaming completion; also the shape of each streamed chunk."""

    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    """An alternative token in chat logprobs."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """The chosen token in chat logprobs with its alternatives."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(BaseModel):
    """Chat logprobs: one entry per generated token."""

    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    """The assistant message of a chat choice."""

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaFunctionCall(BaseModel):
    """The new part of a streamed tool call's function: its name once, then pieces of its arguments."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of one tool call (id, type and name come with its first piece)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """Body of a non-streaming chat completion."""

    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # with the request's (vLLM's)


class DeltaMessage(BaseModel):
    """The new part of a streamed chat message."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    """One choice of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """An entry of GET /v1/models."""

    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "cpuinfer"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    runner: str | None = None  # generate or pooling (embeddings)


class ModelList(BaseModel):
    """GET /v1/models."""

    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorInfo(BaseModel):
    """The inner object of an OpenAI error body."""

    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo

    @classmethod
    def make(cls, message: str, type_: str, code: int, param: str | None = None) -> ErrorResponse:
        """Build an error body."""
        return cls(error=ErrorInfo(message=message, type=type_, param=param, code=code))


def dump(model: BaseModel) -> dict[str, Any]:
    """JSON-ready dict of a response model."""
    return model.model_dump(mode="json")
