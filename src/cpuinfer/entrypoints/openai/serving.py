"""What each OpenAI route does: turn the body into prompts and SamplingParams, start the request
on the engine, and shape the engine's output as OpenAI's JSON or server-sent events.

Every request is started (and so validated, by the engine's one request check) before any byte of
the response is sent: an invalid streaming request gets the same 400 as a non-streaming one. A
failure after that ends a stream with an OpenAI-shaped error event and `data: [DONE]`.

Completions and chat differ only in how prompts are made and how a delta is shaped (a
`_Format` each); the streaming generator and the non-streaming responder are shared.

The engine is reached only through :class:`~cpuinfer.entrypoints.openai.engine_adapter.EngineAdapter`,
which yields per-choice deltas (new text, token ids, logprobs, finish reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.responses import StreamingResponse

from cpuinfer.entrypoints.openai.constraints import engine_param, request_constraint
from cpuinfer.entrypoints.openai.engine_adapter import ChoiceDelta, EngineAdapter, TokenLogprob
from cpuinfer.entrypoints.openai.errors import APIError, to_api_error
from cpuinfer.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from cpuinfer.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
    dump,
    random_id,
)
from cpuinfer.entrypoints.openai.tool_calls import ToolCallStream, tool_constraint, tool_parser_for
from cpuinfer.entrypoints.openai.tool_parsers import ToolParser
from cpuinfer.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger("cpuinfer.server")

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to this too
MAX_SEQUENCES = 1024  # prompts x n of one completions request
# Texts longer than this are tokenized (and chat templates rendered) on a worker thread: the
# tokenizer holds the GIL in encode() but not in encode_batch(), so a multi-MB prompt would
# otherwise stall every other request and /health for seconds.
INLINE_TEXT_CHARS = 16 * 1024


def _lp(x: float) -> float:
    return MIN_LOGPROB if (math.isnan(x) or x < MIN_LOGPROB) else float(x)


def sse(payload: dict | str) -> str:
    """One server-sent event line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def chat_chunk_json(chunk: ChatCompletionChunk) -> dict:
    """A chat chunk as OpenAI sends it: the delta carries only the fields it sets."""
    body = dump(chunk)
    for choice in body["choices"]:
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return body


class DisconnectAwareStream(StreamingResponse):
    """A streaming response that notices a client leaving even while no token is being sent.

    Starlette's default only finds out at the next write; we listen for
    ``http.disconnect`` the whole time so the generator is cancelled (and the
    engine request aborted, KV blocks freed) at once.
    """

    async def __call__(self, scope, receive, send) -> None:  # noqa: ARG002 - the ASGI signature
        async with anyio.create_task_group() as tg:

            async def stream_then_stop():
                with contextlib.suppress(OSError):  # peer gone mid-write
                    await self.stream_response(send)
                tg.cancel_scope.cancel()

            tg.start_soon(stream_then_stop)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()


async def run_until_disconnect(request: Request, coro) -> Any:
    """Await `coro` unless the client disconnects first (then it is cancelled and None returned)."""
    task = asyncio.ensure_future(coro)

    async def wait_disconnect():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def absorb(self, d: ChoiceDelta) -> None:
        """Add a delta."""
        self.text += d.text
        self.token_ids += d.token_ids
        if d.logprobs:
            self.logprobs += d.logprobs
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


@dataclass
class Prompt:
    """One tokenized prompt (text kept for echo)."""

    token_ids: list[int]
    text: str | None


@dataclass
class Job:
    """One HTTP request running on the engine: one engine request per prompt, n choices each."""

    request_id: str
    prompts: list[Prompt]
    n: int
    streams: list[tuple[str, AsyncIterator[list[ChoiceDelta]]]]
    timer: RequestTimer
    states: list[ChoiceState] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.states = [ChoiceState() for _ in range(self.n * len(self.prompts))]

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of all prompts."""
        return sum(len(p.token_ids) for p in self.prompts)

    def usage(self) -> UsageInfo:
        """Token counts so far."""
        c = sum(len(s.token_ids) for s in self.states)
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=c, total_tokens=self.prompt_tokens + c)


class _Format:
    """How one route shapes its chunks and its response (completions and chat each have one)."""

    def __init__(self, serving: OpenAIServing, job: Job):
        self.serving = serving
        self.job = job
        self.created = int(time.time())

    def opening(self) -> list[dict]:
        """Chunks sent before the first delta."""
        return []

    def chunk(self, d: ChoiceDelta) -> dict | None:
        """The chunk for one delta (called before the delta is absorbed), or None when it carries nothing."""
        raise NotImplementedError

    def usage_chunk(self, usage: UsageInfo) -> dict:
        """The final usage-only chunk."""
        raise NotImplementedError

    def response(self) -> BaseModel:
        """The whole non-streaming response."""
        raise NotImplementedError


class _CompletionFormat(_Format):
    def __init__(self, serving: OpenAIServing, job: Job, req: CompletionRequest):
        super().__init__(serving, job)
        self.req = req

    def _body(self, choices: list[CompletionChoice], usage: UsageInfo | None) -> dict:
        return dump(
            CompletionResponse(
                id=self.job.request_id,
                created=self.created,
                model=self.serving.model_name,
                choices=choices,
                usage=usage,
            )
        )

    def _echo(self, i: int) -> str:
        return (self.job.prompts[i // self.job.n].text or "") if self.req.echo else ""

    def opening(self) -> list[dict]:
        if not self.req.echo:
            return []
        return [self._body([CompletionChoice(index=i, text=self._echo(i))], None) for i in range(len(self.job.states))]

    def chunk(self, d: ChoiceDelta) -> dict | None:
        k = self.req.logprobs
        offset = len(self.job.states[d.index].text)
        lp = self.serving.completion_logprobs(d.logprobs or [], k, offset) if k is not None else None
        if not (d.text or d.finish_reason is not None or (lp and lp.tokens)):
            return None
        return self._body(
            [
                CompletionChoice(
                    index=d.index, text=d.text, logprobs=lp, finish_reason=d.finish_reason, stop_reason=d.stop_reason
                )
            ],
            None,
        )

    def usage_chunk(self, usage: UsageInfo) -> dict:
        return self._body([], usage)

    def response(self) -> CompletionResponse:
        k = self.req.logprobs
        choices = []
        for i, s in enumerate(self.job.states):
            prefix = self._echo(i)
            lp = self.serving.completion_logprobs(s.logprobs, k, len(prefix)) if k is not None else None
            choices.append(
                CompletionChoice(
                    index=i, text=prefix + s.text, logprobs=lp, finish_reason=s.finish_reason, stop_reason=s.stop_reason
                )
            )
        return CompletionResponse(
            id=self.job.request_id, model=self.serving.model_name, choices=choices, usage=self.job.usage()
        )


class _ChatFormat(_Format):
    def __init__(self, serving: OpenAIServing, job: Job, req: ChatCompletionRequest, parser: ToolParser | None):
        super().__init__(serving, job)
        self.req = req
        self.k = (req.top_logprobs or 0) if req.logprobs else None
        self.parser = parser  # None: the reply is plain content
        self.streams = [ToolCallStream(parser) for _ in job.states] if parser else []

    def _body(self, choices: list[ChatStreamChoice], usage: UsageInfo | None) -> dict:
        return chat_chunk_json(
            ChatCompletionChunk(
                id=self.job.request_id,
                created=self.created,
                model=self.serving.model_name,
                choices=choices,
                usage=usage,
            )
        )

    def opening(self) -> list[dict]:
        usage = self.job.usage() if _continuous(self.req) else None
        return [
            self._body([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))], usage)
            for i in range(len(self.job.states))
        ]

    def chunk(self, d: ChoiceDelta) -> dict | None:
        lp = self.serving.chat_logprobs(d.logprobs or [], self.k) if self.k is not None else None
        text, calls, finish = d.text, None, d.finish_reason
        if self.parser is not None:
            stream = self.streams[d.index]
            text, calls = stream.feed(d.text, d.finish_reason is not None)
            finish = _finish_reason(finish, bool(stream.ids))
        if not (text or calls or finish is not None or (lp and lp.content)):
            return None
        delta = DeltaMessage(content=text or None, tool_calls=calls or None)
        return self._body(
            [
                ChatStreamChoice(
                    index=d.index, delta=delta, logprobs=lp, finish_reason=finish, stop_reason=d.stop_reason
                )
            ],
            None,
        )

    def usage_chunk(self, usage: UsageInfo) -> dict:
        return self._body([], usage)

    def _message(self, s: ChoiceState) -> tuple[ChatResponseMessage, str | None]:
        if self.parser is None:
            return ChatResponseMessage(content=s.text), s.finish_reason
        stream = ToolCallStream(self.parser, s.text)
        content, calls = stream.final_calls()
        return (
            ChatResponseMessage(content=content or None, tool_calls=calls),
            _finish_reason(s.finish_reason, bool(calls)),
        )

    def response(self) -> ChatCompletionResponse:
        choices = []
        for i, s in enumerate(self.job.states):
            message, finish = self._message(s)
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    finish_reason=finish,
                    stop_reason=s.stop_reason,
                    logprobs=self.serving.chat_logprobs(s.logprobs, self.k) if self.k is not None else None,
                )
            )
        return ChatCompletionResponse(
            id=self.job.request_id, model=self.serving.model_name, choices=choices, usage=self.job.usage()
        )


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended on its own with calls in it."""
    return "tool_calls" if called and reason == "stop" else reason


def _continuous(req: SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.continuous_usage_stats)


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
    ):
        self.engine = engine
        self.tool_call_parser = tool_call_parser  # tool_choice "auto" works only with one
        self.chat_template = chat_template
        self.model_names = served_model_names
        self.metrics = metrics
        self.log_requests = log_requests

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

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of a text; a long one off the event loop."""
        tok = self.engine.tokenization
        if len(text) <= INLINE_TEXT_CHARS:
            return tok.encode(text, add_special_tokens)
        return await anyio.to_thread.run_sync(tok.encode, text, add_special_tokens)

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

    def start(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        timer: RequestTimer,
        max_tokens_name: str = "max_tokens",
        constraint_source: str | None = None,
    ) -> Job:
        """Start every prompt on the engine, all or none (each is validated as it starts)."""
        streams: list[tuple[str, AsyncIterator[list[ChoiceDelta]]]] = []
        try:
            for i, p in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append((rid, self.engine.submit(rid, p.token_ids, params)))
        except Exception as e:
            for rid, _ in streams:
                self.engine.abort(rid)
            err = to_api_error(e)
            err.param = engine_param(err.param, constraint_source)
            if err.param == "max_tokens" and max_tokens_name != "max_tokens":
                err.param = max_tokens_name
                err.message = err.message.replace("'max_tokens'", f"'{max_tokens_name}'")
            raise err from e
        return Job(request_id, prompts, params.n, streams, timer)

    async def _deltas(self, job: Job) -> AsyncIterator[ChoiceDelta]:
        """Every prompt's deltas as they arrive, with choice indexes over the whole request."""
        n = job.n
        if len(job.streams) == 1:
            async for deltas in job.streams[0][1]:
                job.timer.tokens(sum(len(d.token_ids) for d in deltas))
                for d in deltas:
                    yield d
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, stream: AsyncIterator[list[ChoiceDelta]]):
            try:
                async for deltas in stream:
                    await queue.put((i, deltas))
                await queue.put((i, done))
            except Exception as e:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((i, e))

        tasks = [asyncio.ensure_future(pump(i, stream)) for i, (_, stream) in enumerate(job.streams)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                job.timer.tokens(sum(len(d.token_ids) for d in item))
                for d in item:
                    yield ChoiceDelta(i * n + d.index, d.text, d.token_ids, d.logprobs, d.finish_reason, d.stop_reason)
        finally:
            for t in tasks:
                t.cancel()

    def _end(self, job: Job, outcome: str) -> None:
        """Abort whatever still runs (idempotent: frees KV blocks on a disconnect), count and log the request."""
        for rid, _ in job.streams:
            self.engine.abort(rid)
        completion = sum(len(s.token_ids) for s in job.states)
        if self.metrics:
            m = self.metrics
            m.prompt_tokens.inc(job.prompt_tokens)
            m.generation_tokens.inc(completion)
            m.request_prompt_tokens.observe(job.prompt_tokens)
            m.request_generation_tokens.observe(completion)
            if outcome == "ok":
                m.e2e.observe(job.timer.elapsed())
                for s in job.states:
                    m.request_finished(s.finish_reason)
            else:
                m.aborted.inc()
        if self.log_requests:
            ttft = f"{job.timer.ttft * 1000:.1f}ms" if job.timer.ttft is not None else "-"
            logger.info(
                "request %s %s: prompt_tokens=%d completion_tokens=%d ttft=%s total=%.1fms",
                job.request_id,
                outcome,
                job.prompt_tokens,
                completion,
                ttft,
                job.timer.elapsed() * 1000,
            )

    async def _collect(self, job: Job) -> bool:
        """Run to completion (the non-streaming responder's work); True when done."""
        outcome = "aborted"
        try:
            async for d in self._deltas(job):
                job.states[d.index].absorb(d)
            outcome = "ok"
            return True
        except Exception as e:
            outcome = "failed"
            raise to_api_error(e, job.request_id) from e
        finally:
            self._end(job, outcome)

    async def _events(self, fmt: _Format, req: SamplingFields) -> AsyncIterator[str]:
        """The server-sent events of a streaming response; always ends with [DONE] (after an error event if the
        request failed), unless the client is gone."""
        job = fmt.job
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = _continuous(req)
        outcome = "aborted"
        try:
            for chunk in fmt.opening():
                yield sse(chunk)
            async for d in self._deltas(job):
                body = fmt.chunk(d)
                job.states[d.index].absorb(d)
                if body is not None:
                    if continuous:
                        body["usage"] = dump(job.usage())
                    yield sse(body)
            if include_usage:
                yield sse(fmt.usage_chunk(job.usage()))
            outcome = "ok"
        except Exception as e:  # noqa: BLE001 - any failure mid-stream becomes an OpenAI error event
            outcome = "failed"
            yield sse(to_api_error(e, job.request_id).body())
        finally:
            self._end(job, outcome)
        yield sse("[DONE]")

    async def _respond(self, raw: Request, req: SamplingFields, fmt: _Format):
        """A started job as SSE (stream) or one JSON body."""
        if req.stream:
            return DisconnectAwareStream(self._events(fmt, req), media_type="text/event-stream")
        if not await run_until_disconnect(raw, self._collect(fmt.job)):
            return JSONResponse({}, status_code=499)  # the client left (nginx's code); nobody reads this
        return JSONResponse(dump(fmt.response()))

    # ---- logprobs shaping ----------------------------------------------------------------------

    def completion_logprobs(self, entries: list[TokenLogprob], k: int, offset0: int) -> CompletionLogProbs:
        """Legacy completions logprobs for generated tokens."""
        tok = self.engine.tokenization
        out = CompletionLogProbs()
        offset = offset0
        for e in entries:
            text = tok.token_text(e.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(_lp(e.logprob))
            top = {tok.token_text(t): _lp(lp) for t, lp in e.top[:k]}
            top.setdefault(text, _lp(e.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def chat_logprobs(self, entries: list[TokenLogprob], k: int) -> ChatLogProbs:
        """Chat logprobs for generated tokens."""
        tok = self.engine.tokenization
        content = []
        for e in entries:
            text = tok.token_text(e.token_id)
            content.append(
                ChatTokenLogprob(
                    token=text,
                    logprob=_lp(e.logprob),
                    bytes=list(text.encode("utf-8")),
                    top_logprobs=[
                        TopLogprob(
                            token=(t_text := tok.token_text(t)), logprob=_lp(lp), bytes=list(t_text.encode("utf-8"))
                        )
                        for t, lp in e.top[:k]
                    ],
                )
            )
        return ChatLogProbs(content=content)

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
        count = len(texts) if texts is not None else len(p)
        if count * req.n > MAX_SEQUENCES:
            raise APIError(f"Too many sequences: {count} prompts x n={req.n} exceeds {MAX_SEQUENCES}.", 400, "prompt")
        if texts is None:
            return [Prompt(list(x), None) for x in p]
        return [Prompt(await self.encode(t, add), t) for t in texts]

    async def completions(self, req: CompletionRequest, raw: Request):
        """POST /v1/completions."""
        self.check_model(req.model)
        self.check_ready()
        if req.echo and req.logprobs is not None:
            raise APIError("echo together with logprobs is not supported; drop one of them.", 400, "echo")
        prompts = await self._completion_prompts(req)
        constraint, source = request_constraint(req)
        params = self.sampling_params(req, req.max_tokens, req.logprobs, constraint)
        job = self.start(random_id("cmpl"), prompts, params, RequestTimer(self.metrics), constraint_source=source)
        if req.echo:  # the ids are known to be in the vocabulary now
            tok = self.engine.tokenization
            for p in prompts:
                if p.text is None:
                    p.text = tok.decode(p.token_ids, skip_special_tokens=False)
        return await self._respond(raw, req, _CompletionFormat(self, job, req))

    # ---- /v1/chat/completions ------------------------------------------------------------------

    async def _chat_prompt(
        self, req: ChatCompletionRequest | TokenizeChatRequest, add_special_tokens: bool, continue_final: bool = False
    ) -> Prompt:
        messages = [m.template_dict() for m in req.messages]
        tools = None
        if isinstance(req, ChatCompletionRequest) and req.tools and req.tool_choice != "none":
            tools = [t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in req.tools]
        template = getattr(req, "chat_template", None) or self.chat_template
        args = (
            messages,
            req.add_generation_prompt,
            continue_final,
            add_special_tokens,
            tools,
            template,
            getattr(req, "chat_template_kwargs", None),
        )
        encode_chat = self.engine.tokenization.encode_chat
        try:
            if sum(len(m["content"]) for m in messages) <= INLINE_TEXT_CHARS:
                text, ids = encode_chat(*args)
            else:
                text, ids = await anyio.to_thread.run_sync(encode_chat, *args)
        except Exception as e:  # template errors are about the conversation the client sent
            raise APIError(f"The chat template cannot format these messages: {e}", 400, "messages") from e
        return Prompt(ids, text)

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        """POST /v1/chat/completions."""
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
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        job = self.start(random_id("chatcmpl"), [prompt], params, RequestTimer(self.metrics), name, source)
        return await self._respond(raw, req, _ChatFormat(self, job, req, parser))

    # ---- models, tokenize ----------------------------------------------------------------------

    def models(self) -> ModelList:
        """GET /v1/models."""
        root = self.engine.model_path
        return ModelList(
            data=[ModelCard(id=name, root=root, max_model_len=self.engine.max_model_len) for name in self.model_names]
        )

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
        from cpuinfer.engine.limits import check_token_ids

        self.check_model(req.model)
        try:
            check_token_ids(req.tokens, self.engine.tokenization.vocab_size, "tokens")
        except ValueError as e:
            raise to_api_error(e) from e
        text = await anyio.to_thread.run_sync(self.engine.tokenization.decode, req.tokens, False)
        return DetokenizeResponse(prompt=text)
