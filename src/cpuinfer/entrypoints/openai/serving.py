"""What each OpenAI route does: turn the body into prompts and SamplingParams, start the request on
the engine, and answer it through the responder (responder.py: one streaming generator and one
non-streaming responder for every route) in the route's format (formats.py).

The engine is reached only through :class:`~cpuinfer.entrypoints.openai.engine_adapter.EngineAdapter`,
which yields per-choice deltas (new text, token ids, logprobs, finish reason).
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response

from cpuinfer.engine.limits import check_token_ids, validate_batch
from cpuinfer.entrypoints.openai.constraints import engine_param, request_constraint
from cpuinfer.entrypoints.openai.embeddings import create_embeddings
from cpuinfer.entrypoints.openai.embeddings_protocol import EmbeddingRequest, EmbeddingResponse
from cpuinfer.entrypoints.openai.engine_adapter import EngineAdapter
from cpuinfer.entrypoints.openai.errors import APIError, to_api_error
from cpuinfer.entrypoints.openai.formats import ChatFormat, CompletionFormat
from cpuinfer.entrypoints.openai.job import Job, Prompt
from cpuinfer.entrypoints.openai.metrics import ServerMetrics
from cpuinfer.entrypoints.openai.prep_pool import PrepPool
from cpuinfer.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    random_id,
)
from cpuinfer.entrypoints.openai.responder import Responder
from cpuinfer.entrypoints.openai.responses_api import ResponsesFormat, response_id
from cpuinfer.entrypoints.openai.responses_protocol import ResponsesRequest
from cpuinfer.entrypoints.openai.scoring import create_classify, create_rerank, create_score
from cpuinfer.entrypoints.openai.scoring_protocol import (
    ClassificationRequest,
    ClassificationResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from cpuinfer.entrypoints.openai.tool_calls import tool_constraint, tool_parser_for
from cpuinfer.entrypoints.openai.tool_parsers import ToolParser
from cpuinfer.errors import InvalidRequestError
from cpuinfer.model_loader.chat_template import TemplateOutputTooLarge
from cpuinfer.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

# Texts longer than this are tokenized (and chat templates rendered) in a request-preparation worker process
# (prep_pool.py): Jinja and the tokenizer's Python side hold the GIL, so a multi-MB prompt or a slow template
# would otherwise stall every other request and /health for seconds. Shorter ones are quicker done here.
INLINE_TEXT_CHARS = 16 * 1024
INLINE_MESSAGES = 64


class OpenAIServing:
    """Handlers of every OpenAI route, bound to one engine and one served model name."""

    def __init__(
        self,
        engine: EngineAdapter,
        served_model_names: list[str],
        metrics: ServerMetrics | None,
        log_requests: bool = True,
        tool_call_parser: str | None = None,
        chat_template: str | None = None,
        prep: PrepPool | None = None,
        draining: asyncio.Event | None = None,
        window_sequences: int = 16,
        log_prompts: bool = False,
        max_log_len: int | None = None,
    ):
        self.engine = engine
        self.prep = prep  # worker processes for large prompts and request templates (None: threads)
        self.tool_call_parser = tool_call_parser  # tool_choice "auto" works only with one
        self.chat_template = chat_template
        self.model_names = served_model_names
        self.responder = Responder(
            engine, metrics, log_requests, draining, window_sequences, log_prompts=log_prompts, max_log_len=max_log_len
        )

    # ---- helpers -------------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        """The primary served model name (what responses report)."""
        return self.model_names[0]

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is one of ours (an omitted model means the default)."""
        if model is not None and model not in self.model_names:
            raise APIError(
                f"The model `{model}` does not exist. Available: {', '.join(self.model_names)}.", 404, "model"
            )

    def check_ready(self) -> None:
        """503 when the engine is not serving."""
        if not self.engine.healthy:
            raise APIError(f"The engine is not running ({self.engine.status_text()}); retry later.", 503)

    def char_limits(self) -> tuple[int, int]:
        """The most characters of prompt text that could ever fit (one prompt: the context; one request: its
        prompt-token cap), at the longest token's text per token."""
        per_token = self.engine.tokenization.max_token_chars
        return self.engine.max_model_len * per_token, self.engine.limits.max_request_prompt_tokens * per_token

    async def _prepare(self, inline: bool, method: str, *args: Any) -> Any:
        """Tokenization.<method>(*args): here when small, else in a worker process (or a thread without a pool);
        an engine error (a limit, bad text) becomes the APIError naming its field."""
        tok = self.engine.tokenization
        try:
            if inline:
                return getattr(tok, method)(*args)
            if self.prep is not None:
                return await self.prep.run(method, *args)
            return await anyio.to_thread.run_sync(getattr(tok, method), *args)
        except InvalidRequestError as e:
            raise to_api_error(e) from e

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of a text; a long one off the event loop."""
        return await self._prepare(len(text) <= INLINE_TEXT_CHARS, "encode", text, add_special_tokens)

    async def encode_many(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Token ids of each text (one tokenizer call); long ones in all off the event loop."""
        inline = sum(len(t) for t in texts) <= INLINE_TEXT_CHARS
        return await self._prepare(inline, "encode_many", texts, add_special_tokens)

    async def encode_pairs(self, pairs: list[tuple[str, str]], max_length: int | None) -> list:
        """(token ids, token types) of each text pair as one cross-encoder input; many off the event loop."""
        inline = sum(len(a) + len(b) for a, b in pairs) <= INLINE_TEXT_CHARS
        return await self._prepare(inline, "encode_pairs", pairs, max_length)

    async def compile_constraint(self, constraint: StructuredOutputsParams | None, source: str | None) -> None:
        """Compile the request's constraint on a worker thread (the grammar backend releases the GIL): a 128 KiB
        schema takes ~0.3-0.6 s, which on the event loop would delay every other request."""
        if constraint is None:
            return
        try:
            await anyio.to_thread.run_sync(self.engine.compile_constraint, constraint)
        except InvalidRequestError as e:
            err = to_api_error(e)
            err.param = engine_param(err.param, source)
            raise err from e

    def sampling_params(
        self,
        req: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
        constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams (model defaults fill unset fields); a bad field is a 400 naming it."""
        defaults = self.engine.generation_defaults
        kw: dict[str, Any] = {
            "structured_outputs": constraint,
            "logit_bias": req.logit_bias_ids(),
            "n": req.n,
            "presence_penalty": req.presence_penalty or 0.0,
            "frequency_penalty": req.frequency_penalty or 0.0,
            "seed": req.seed,
            "stop": [req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            "stop_token_ids": list(req.stop_token_ids or []),
            "max_tokens": max_tokens,
            "min_tokens": req.min_tokens,
            "ignore_eos": req.ignore_eos,
            "logprobs": logprobs,
            "skip_special_tokens": req.skip_special_tokens,
            "spaces_between_special_tokens": req.spaces_between_special_tokens,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "output_kind": RequestOutputKind.DELTA,
            "prediction": req.prediction.text if req.prediction is not None else None,
        }
        for name, fallback in (
            ("temperature", 1.0),
            ("top_p", 1.0),
            ("top_k", 0),
            ("min_p", 0.0),
            ("repetition_penalty", 1.0),
        ):
            value = getattr(req, name)
            kw[name] = value if value is not None else defaults.get(name, fallback)
        if kw["top_k"] is None or kw["top_k"] == -1:
            kw["top_k"] = 0
        try:
            return SamplingParams(**kw)
        except (ValueError, TypeError) as e:
            raise to_api_error(e) from e

    # ---- /v1/completions -----------------------------------------------------------------------

    async def _completion_prompts(self, req: CompletionRequest) -> list[Prompt]:
        p = req.prompt
        add = req.add_special_tokens
        if isinstance(p, str):
            texts: list[str] | None = [p]
        elif all(isinstance(x, int) for x in p):
            return [Prompt(list(p), None)]
        elif all(isinstance(x, str) for x in p):
            texts = list(p)
        else:
            texts = None
        if texts is None:
            return [Prompt(list(x), None) for x in p]
        ids = await self.encode_many(texts, add)
        return [Prompt(i, t) for i, t in zip(ids, texts, strict=True)]

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        """POST /v1/completions."""
        self.check_model(req.model)
        self.check_ready()
        prompts = await self._completion_prompts(req)
        constraint, source = request_constraint(req)
        params = self.sampling_params(req, req.max_tokens, req.logprobs, constraint)
        # echo with logprobs shows the prompt tokens' logprobs too (OpenAI's legacy scoring, lm-eval's loglikelihood).
        wanted = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
        if wanted:
            params = params.clone(prompt_logprobs=max(wanted))
        await self.compile_constraint(constraint, source)
        try:
            in_flight = self.responder.window(len(prompts), params.n) * params.n
            validate_batch([len(p.token_ids) for p in prompts], params, self.engine.limits, in_flight)
        except InvalidRequestError as e:
            raise to_api_error(e) from e
        job = self.responder.start(random_id("cmpl"), prompts, params, constraint_source=source)
        if req.echo:  # the ids are known to be in the vocabulary now
            tok = self.engine.tokenization
            for p in prompts:
                if p.text is None:
                    p.text = tok.decode(p.token_ids, skip_special_tokens=False)
        fmt = CompletionFormat(job, self.model_name, self.engine.tokenization, req)
        return await self.responder.respond(raw, req, fmt)

    # ---- /v1/chat/completions ------------------------------------------------------------------

    async def _chat_prompt(
        self, req: ChatCompletionRequest | TokenizeChatRequest, add_special_tokens: bool, continue_final: bool = False
    ) -> Prompt:
        messages = [m.template_dict() for m in req.messages]
        tools = None
        if isinstance(req, ChatCompletionRequest) and req.tools and req.tool_choice != "none":
            tools = [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in req.tools]
        own_template = getattr(req, "chat_template", None)
        kwargs = getattr(req, "chat_template_kwargs", None)
        args = (
            messages,
            req.add_generation_prompt,
            continue_final,
            add_special_tokens,
            tools,
            own_template or self.chat_template,
            kwargs,
            self.char_limits()[0],  # a longer prompt never fits the context
        )
        # The server's template on a small conversation is quicker rendered here; anything the request supplies
        # (a template, its variables) or anything large goes to a worker, which a timeout can stop.
        inline = (
            own_template is None
            and not kwargs
            and len(messages) <= INLINE_MESSAGES
            and sum(len(m["content"]) for m in messages) <= INLINE_TEXT_CHARS
        )
        try:
            text, ids = await self._prepare(inline, "encode_chat", *args)
        except APIError:
            raise
        except TemplateOutputTooLarge as e:
            raise APIError(f"The chat template's output is too large: {e}.", 400, "messages") from e
        except Exception as e:  # template errors are about the conversation the client sent
            raise APIError(f"The chat template cannot format these messages: {e}", 400, "messages") from e
        return Prompt(ids, text)

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        """POST /v1/chat/completions."""
        job, parser = await self.start_chat(req, random_id("chatcmpl"))
        fmt = ChatFormat(job, self.model_name, self.engine.tokenization, req, parser)
        return await self.responder.respond(raw, req, fmt)

    async def start_chat(
        self, req: ChatCompletionRequest, request_id: str, max_tokens_name: str | None = None
    ) -> tuple[Job, ToolParser | None]:
        """Check, render and start a chat request (also what /v1/responses runs); returns the running job and
        the parser that finds tool calls in its reply (None: plain content)."""
        self.check_model(req.model)
        self.check_ready()
        parser = tool_parser_for(req, self.tool_call_parser)
        constraint, source = request_constraint(req)
        forced = tool_constraint(req)
        if forced is not None:
            if constraint is not None:
                raise APIError(f"a forcing tool_choice cannot be combined with {source}", 400, source)
            constraint, source = forced, "tools"
        prompt = await self._chat_prompt(req, req.add_special_tokens, req.continue_final_message)
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, req.output_limit(), k, constraint)
        if req.prompt_logprobs is not None:
            params = params.clone(prompt_logprobs=req.prompt_logprobs)
        await self.compile_constraint(constraint, source)
        name = max_tokens_name or ("max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
        return self.responder.start(request_id, [prompt], params, name, source), parser

    async def responses(self, req: ResponsesRequest, raw: Request) -> Response:
        """POST /v1/responses: the chat request it means, answered in the Responses API's shape."""
        chat = req.chat_request()
        job, parser = await self.start_chat(chat, response_id(), "max_output_tokens")
        fmt = ResponsesFormat(job, self.model_name, self.engine.tokenization, req, parser)
        return await self.responder.respond(raw, chat, fmt)

    # ---- models, tokenize ----------------------------------------------------------------------

    def models(self) -> ModelList:
        """GET /v1/models."""
        root = self.engine.model_path
        return ModelList(
            data=[
                ModelCard(id=name, root=root, max_model_len=self.engine.max_model_len, runner=self.engine.runner)
                for name in self.model_names
            ]
        )

    async def embeddings(self, req: EmbeddingRequest, raw: Request | None = None) -> EmbeddingResponse | None:
        """POST /v1/embeddings (a pooling model's); None when the client left before it was done."""
        return await create_embeddings(self, req, raw)

    async def score(self, req: ScoreRequest, raw: Request | None = None) -> ScoreResponse | None:
        """POST /score; None when the client left before it was done."""
        return await create_score(self, req, raw)

    async def rerank(self, req: RerankRequest, raw: Request | None = None) -> RerankResponse | None:
        """POST /rerank; None when the client left before it was done."""
        return await create_rerank(self, req, raw)

    async def classify(self, req: ClassificationRequest, raw: Request | None = None) -> ClassificationResponse | None:
        """POST /classify; None when the client left before it was done."""
        return await create_classify(self, req, raw)

    async def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """POST /tokenize."""
        self.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            ids = (await self._chat_prompt(req, req.add_special_tokens)).token_ids
        else:
            ids = await self.encode(req.prompt, req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """POST /detokenize."""

        self.check_model(req.model)
        try:
            check_token_ids(req.tokens, self.engine.tokenization.vocab_size, "tokens")
        except ValueError as e:
            raise to_api_error(e) from e
        text = await anyio.to_thread.run_sync(self.engine.tokenization.decode, req.tokens, False)
        return DetokenizeResponse(prompt=text)
