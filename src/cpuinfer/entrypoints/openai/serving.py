"""What each OpenAI route does: validate against the model, run the request on the engine,
and shape the engine's output as OpenAI's JSON or server-sent events.

The engine is reached only through :class:`~cpuinfer.entrypoints.openai.engine_adapter.EngineAdapter`,
which yields per-choice deltas (new text, token ids, logprobs, finish reason).
"""

from __future__ import annotations

import asyncio
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
from starlette.responses import StreamingResponse

from cpuinfer.entrypoints.openai.engine_adapter import ChoiceDelta, EngineAdapter, EngineDeadError, TokenLogprob
from cpuinfer.entrypoints.openai.errors import APIError, error_body
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

logger = logging.getLogger("cpuinfer.server")

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to this too


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

    async def __call__(self, scope, receive, send) -> None:  # noqa: D401 - ASGI entry
        async with anyio.create_task_group() as tg:

            async def stream_then_stop():
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # peer gone mid-write
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
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    return None


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class PreparedPrompt:
    """One prompt after tokenization and length checks."""

    token_ids: list[int]
    text: str | None
    max_tokens: int


class OpenAIServing:
    """Handlers of every OpenAI route, bound to one engine and one served model name."""

    def __init__(self, engine: EngineAdapter, served_model_names: list[str], metrics: ServerMetrics | None,
                 log_requests: bool = True):
        self.engine = engine
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
            raise APIError(f"The model `{model}` does not exist. Available: {', '.join(self.model_names)}.",
                           404, "model")

    def check_ready(self) -> None:
        """503 when the engine is not serving."""
        if not self.engine.healthy:
            raise APIError(f"The engine is not running ({self.engine.status_text()}); retry later.", 503)

    def prepare(self, token_ids: list[int], text: str | None, max_tokens: int | None,
                param: str = "max_tokens") -> PreparedPrompt:
        """Check a tokenized prompt against the context length and vocabulary; resolve max_tokens."""
        limit = self.engine.max_model_len
        n = len(token_ids)
        if n == 0:
            raise APIError("The prompt is empty (0 tokens); send at least one token.", 400, "prompt")
        vocab = self.engine.tokenization.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"Token id {bad} is out of the vocabulary (valid ids are 0..{vocab - 1}).", 400, "prompt")
        if n >= limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, your request has "
                           f"{n} input tokens. Please reduce the length of the input.", 400, "prompt")
        if max_tokens is None:
            max_tokens = limit - n
        elif n + max_tokens > limit:
            raise APIError(f"'{param}' is too large: {max_tokens}. This model's maximum context length is {limit} "
                           f"tokens and your request has {n} input tokens ({max_tokens} > {limit} - {n}).",
                           400, param)
        return PreparedPrompt(token_ids, text, max_tokens)

    def sampling_kwargs(self, req: SamplingFields, max_tokens: int, logprobs: int | None) -> dict:
        """vLLM SamplingParams keyword arguments for a request (model defaults fill unset fields)."""
        defaults = self.engine.generation_defaults
        kw: dict[str, Any] = {
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
        }
        for name, fallback in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                               ("repetition_penalty", 1.0)):
            value = getattr(req, name)
            kw[name] = value if value is not None else defaults.get(name, fallback)
        if kw["top_k"] is None or kw["top_k"] == -1:
            kw["top_k"] = 0
        return kw

    async def _stream_choices(self, request_id: str, prompts: list[PreparedPrompt], sampling: dict,
                              timer: RequestTimer) -> AsyncIterator[tuple[int, ChoiceDelta]]:
        """Run every prompt on the engine; yield (prompt index, delta) as they arrive."""
        n = sampling["n"]
        if len(prompts) == 1:
            async for deltas in self.engine.generate(request_id, prompts[0].token_ids, sampling):
                timer.tokens(sum(len(d.token_ids) for d in deltas))
                for d in deltas:
                    yield 0, d
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, p: PreparedPrompt):
            try:
                params = dict(sampling, max_tokens=p.max_tokens)
                async for deltas in self.engine.generate(f"{request_id}-{i}", p.token_ids, params):
                    await queue.put((i, deltas))
                await queue.put((i, done))
            except BaseException as e:  # noqa: B036 - forwarded to the consumer
                await queue.put((i, e))

        tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(prompts)]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                timer.tokens(sum(len(d.token_ids) for d in item))
                for d in item:
                    yield i, ChoiceDelta(i * n + d.index, d.text, d.token_ids, d.logprobs, d.finish_reason,
                                         d.stop_reason)
        finally:
            for t in tasks:
                t.cancel()

    def _finish_log(self, request_id: str, prompt_tokens: int, states: list[ChoiceState], timer: RequestTimer,
                    outcome: str) -> None:
        completion = sum(len(s.token_ids) for s in states)
        if self.metrics:
            m = self.metrics
            m.prompt_tokens.inc(prompt_tokens)
            m.generation_tokens.inc(completion)
            m.request_prompt_tokens.observe(prompt_tokens)
            m.request_generation_tokens.observe(completion)
            if outcome == "ok":
                m.e2e.observe(timer.elapsed())
                for s in states:
                    m.request_finished(s.finish_reason)
            else:
                m.aborted.inc()
        if self.log_requests:
            ttft = f"{timer.ttft * 1000:.1f}ms" if timer.ttft is not None else "-"
            logger.info("request %s %s: prompt_tokens=%d completion_tokens=%d ttft=%s total=%.1fms", request_id,
                        outcome, prompt_tokens, completion, ttft, timer.elapsed() * 1000)

    async def _collect(self, request_id: str, prompts: list[PreparedPrompt], sampling: dict,
                       timer: RequestTimer) -> list[ChoiceState]:
        """Run to completion; the per-choice results in choice order."""
        n = sampling["n"]
        states = [ChoiceState() for _ in range(n * len(prompts))]
        outcome = "aborted"
        try:
            async for _, d in self._stream_choices(request_id, prompts, sampling, timer):
                s = states[d.index]
                s.text += d.text
                s.token_ids += d.token_ids
                if d.logprobs:
                    s.logprobs += d.logprobs
                if d.finish_reason is not None:
                    s.finish_reason, s.stop_reason = d.finish_reason, d.stop_reason
            outcome = "ok"
            return states
        except EngineDeadError as e:
            outcome = "failed"
            raise APIError(f"The engine failed while running the request: {e}", 500) from e
        finally:
            self._finish_log(request_id, sum(len(p.token_ids) for p in prompts), states, timer, outcome)

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
            content.append(ChatTokenLogprob(
                token=text, logprob=_lp(e.logprob), bytes=list(text.encode("utf-8")),
                top_logprobs=[TopLogprob(token=(t_text := tok.token_text(t)), logprob=_lp(lp),
                                         bytes=list(t_text.encode("utf-8"))) for t, lp in e.top[:k]]))
        return ChatLogProbs(content=content)

    # ---- /v1/completions -----------------------------------------------------------------------

    def _completion_prompts(self, req: CompletionRequest) -> list[PreparedPrompt]:
        tok = self.engine.tokenization
        p = req.prompt
        if isinstance(p, str):
            raw: list[tuple[list[int], str | None]] = [(tok.encode(p, req.add_special_tokens), p)]
        elif all(isinstance(x, int) for x in p):
            raw = [(list(p), None)]
        elif all(isinstance(x, str) for x in p):
            raw = [(tok.encode(x, req.add_special_tokens), x) for x in p]
        else:
            raw = [(list(x), None) for x in p]
        if len(raw) * req.n > 1024:
            raise APIError(f"Too many sequences: {len(raw)} prompts x n={req.n} exceeds 1024.", 400, "prompt")
        return [self.prepare(ids, text, req.max_tokens) for ids, text in raw]

    async def completions(self, req: CompletionRequest, raw: Request):
        """POST /v1/completions."""
        self.check_model(req.model)
        self.check_ready()
        prompts = self._completion_prompts(req)
        if req.echo and req.logprobs is not None:
            raise APIError("echo together with logprobs is not supported; drop one of them.", 400, "echo")
        sampling = self.sampling_kwargs(req, prompts[0].max_tokens, req.logprobs)
        request_id = random_id("cmpl")
        timer = RequestTimer(self.metrics)
        tok = self.engine.tokenization
        if req.echo:
            for p in prompts:
                if p.text is None:
                    p.text = tok.decode(p.token_ids, skip_special_tokens=False)
        if req.stream:
            return DisconnectAwareStream(self._completion_stream(req, request_id, prompts, sampling, timer),
                                         media_type="text/event-stream")
        states = await run_until_disconnect(raw, self._collect(request_id, prompts, sampling, timer))
        if states is None:
            return JSONResponse({}, status_code=499)
        choices = []
        for i, s in enumerate(states):
            prefix = prompts[i // req.n].text if req.echo else ""
            lp = (self.completion_logprobs(s.logprobs, req.logprobs, len(prefix or ""))
                  if req.logprobs is not None else None)
            choices.append(CompletionChoice(index=i, text=(prefix or "") + s.text, logprobs=lp,
                                            finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        completion_tokens = sum(len(s.token_ids) for s in states)
        body = CompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                  usage=UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                                  total_tokens=prompt_tokens + completion_tokens))
        return JSONResponse(dump(body))

    async def _completion_stream(self, req: CompletionRequest, request_id: str, prompts: list[PreparedPrompt],
                                 sampling: dict, timer: RequestTimer) -> AsyncIterator[str]:
        n = req.n
        states = [ChoiceState() for _ in range(n * len(prompts))]
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        created = int(time.time())

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return sse(dump(CompletionResponse(id=request_id, created=created, model=self.model_name,
                                               choices=choices, usage=usage)))

        def usage_now() -> UsageInfo:
            c = sum(len(s.token_ids) for s in states)
            return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=c, total_tokens=prompt_tokens + c)

        outcome = "aborted"
        try:
            if req.echo:
                for i in range(len(states)):
                    yield chunk([CompletionChoice(index=i, text=prompts[i // n].text or "")])
            async for _, d in self._stream_choices(request_id, prompts, sampling, timer):
                s = states[d.index]
                lp = None
                if req.logprobs is not None:
                    lp = self.completion_logprobs(d.logprobs or [], req.logprobs, len(s.text))
                s.text += d.text
                s.token_ids += d.token_ids
                if d.finish_reason is not None:
                    s.finish_reason, s.stop_reason = d.finish_reason, d.stop_reason
                if d.text or d.finish_reason is not None or (lp and lp.tokens):
                    yield chunk([CompletionChoice(index=d.index, text=d.text, logprobs=lp,
                                                  finish_reason=d.finish_reason, stop_reason=d.stop_reason)],
                                usage_now() if continuous else None)
            if include_usage:
                yield chunk([], usage_now())
            outcome = "ok"
        except EngineDeadError as e:
            outcome = "failed"
            yield sse(error_body(f"The engine failed while running the request: {e}", 500))
        finally:
            self._finish_log(request_id, prompt_tokens, states, timer, outcome)
        yield sse("[DONE]")

    # ---- /v1/chat/completions ------------------------------------------------------------------

    def _chat_prompt(self, req: ChatCompletionRequest | TokenizeChatRequest, add_special_tokens: bool,
                     continue_final: bool = False) -> tuple[list[int], str]:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = self.engine.tokenization.chat_prompt(messages, req.add_generation_prompt, continue_final)
        except APIError:
            raise
        except Exception as e:  # template errors are about the conversation the client sent
            raise APIError(f"The chat template cannot format these messages: {e}", 400, "messages") from e
        return self.engine.tokenization.encode(text, add_special_tokens), text

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        """POST /v1/chat/completions."""
        self.check_model(req.model)
        self.check_ready()
        ids, text = self._chat_prompt(req, req.add_special_tokens, req.continue_final_message)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        prompt = self.prepare(ids, text, req.output_limit(), param)
        k = (req.top_logprobs or 0) if req.logprobs else None
        sampling = self.sampling_kwargs(req, prompt.max_tokens, k)
        request_id = random_id("chatcmpl")
        timer = RequestTimer(self.metrics)
        if req.stream:
            return DisconnectAwareStream(self._chat_stream(req, request_id, prompt, sampling, timer),
                                         media_type="text/event-stream")
        states = await run_until_disconnect(raw, self._collect(request_id, [prompt], sampling, timer))
        if states is None:
            return JSONResponse({}, status_code=499)
        choices = [ChatChoice(index=i, message=ChatResponseMessage(content=s.text),
                              logprobs=self.chat_logprobs(s.logprobs, k) if k is not None else None,
                              finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                   for i, s in enumerate(states)]
        completion_tokens = sum(len(s.token_ids) for s in states)
        n_prompt = len(prompt.token_ids)
        body = ChatCompletionResponse(id=request_id, model=self.model_name, choices=choices,
                                      usage=UsageInfo(prompt_tokens=n_prompt, completion_tokens=completion_tokens,
                                                      total_tokens=n_prompt + completion_tokens))
        return JSONResponse(dump(body))

    async def _chat_stream(self, req: ChatCompletionRequest, request_id: str, prompt: PreparedPrompt,
                           sampling: dict, timer: RequestTimer) -> AsyncIterator[str]:
        n = req.n
        states = [ChoiceState() for _ in range(n)]
        n_prompt = len(prompt.token_ids)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        k = (req.top_logprobs or 0) if req.logprobs else None
        created = int(time.time())

        def usage_now() -> UsageInfo:
            c = sum(len(s.token_ids) for s in states)
            return UsageInfo(prompt_tokens=n_prompt, completion_tokens=c, total_tokens=n_prompt + c)

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(chat_chunk_json(ChatCompletionChunk(id=request_id, created=created, model=self.model_name,
                                                           choices=choices, usage=usage)))

        outcome = "aborted"
        try:
            for i in range(n):
                yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))],
                            usage_now() if continuous else None)
            async for _, d in self._stream_choices(request_id, [prompt], sampling, timer):
                s = states[d.index]
                s.text += d.text
                s.token_ids += d.token_ids
                if d.finish_reason is not None:
                    s.finish_reason, s.stop_reason = d.finish_reason, d.stop_reason
                lp = self.chat_logprobs(d.logprobs or [], k) if k is not None else None
                if d.text or d.finish_reason is not None or (lp and lp.content):
                    delta = DeltaMessage(content=d.text) if d.text else DeltaMessage()
                    yield chunk([ChatStreamChoice(index=d.index, delta=delta, logprobs=lp,
                                                  finish_reason=d.finish_reason, stop_reason=d.stop_reason)],
                                usage_now() if continuous else None)
            if include_usage:
                yield chunk([], usage_now())
            outcome = "ok"
        except EngineDeadError as e:
            outcome = "failed"
            yield sse(error_body(f"The engine failed while running the request: {e}", 500))
        finally:
            self._finish_log(request_id, n_prompt, states, timer, outcome)
        yield sse("[DONE]")

    # ---- models, tokenize ----------------------------------------------------------------------

    def models(self) -> ModelList:
        """GET /v1/models."""
        root = self.engine.model_path
        return ModelList(data=[ModelCard(id=name, root=root, max_model_len=self.engine.max_model_len)
                               for name in self.model_names])

    def tokenize(self, req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        """POST /tokenize."""
        self.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            ids, _ = self._chat_prompt(req, req.add_special_tokens)
        else:
            ids = self.engine.tokenization.encode(req.prompt, req.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """POST /detokenize."""
        self.check_model(req.model)
        vocab = self.engine.tokenization.vocab_size
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(f"Token id {bad} is out of the vocabulary (valid ids are 0..{vocab - 1}).", 400, "tokens")
        return DetokenizeResponse(prompt=self.engine.tokenization.decode(req.tokens, skip_special_tokens=False))
