"""Starting a generation request on the engine and answering it, the same way for every route.

Every prompt is started (and so validated, by the engine's one request check) before any byte of the
response is sent: an invalid streaming request gets the same 400 as a non-streaming one. Then one
streaming generator or one non-streaming responder runs the job; both end it in one place (`_end`:
engine requests aborted, which frees their KV blocks when the client left; metrics; the request log).
A failure after the start ends a stream with an OpenAI-shaped error event, and every stream ends with
`data: [DONE]`. A client that disconnects cancels the job at once, even while no token is being sent.
A request of many prompts keeps at most --request-window-sequences sequences in the engine at once (its other
prompts, validated up front, start as earlier ones finish), so another client's small request is never queued
behind all of it.
At shutdown, once --shutdown-timeout has passed, every job still running ends the same way (a 503 error event,
then `data: [DONE]`; a 503 body when not streaming) before the HTTP server cancels what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse

from cpuinfer.entrypoints.openai.constraints import engine_param
from cpuinfer.entrypoints.openai.engine_adapter import ChoiceDelta, EngineAdapter
from cpuinfer.entrypoints.openai.errors import APIError, to_api_error
from cpuinfer.entrypoints.openai.formats import ResponseFormat, continuous_usage
from cpuinfer.entrypoints.openai.job import Job, Prompt
from cpuinfer.entrypoints.openai.metrics import RequestTimer, ServerMetrics
from cpuinfer.entrypoints.openai.protocol import SamplingFields, dump
from cpuinfer.errors import EngineOverloadedError
from cpuinfer.sampling_params import SamplingParams

logger = logging.getLogger("cpuinfer.server")
SHUTDOWN_MESSAGE = "The server is shutting down; this request was stopped. Retry on another replica."


def sse(payload: dict | str) -> str:
    """One server-sent event line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


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


async def run_until_disconnect(request: Request, coro: Coroutine) -> Any:
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


class Responder:
    """Runs jobs on one engine and answers them as SSE or one JSON body."""

    def __init__(
        self,
        engine: EngineAdapter,
        metrics: ServerMetrics | None,
        log_requests: bool,
        draining: asyncio.Event | None = None,
        window_sequences: int = 16,
        log_prompts: bool = False,
        max_log_len: int | None = None,
    ):
        self.engine = engine
        self.metrics = metrics
        self.log_requests = log_requests
        self.draining = draining  # set when the shutdown grace period is over: running jobs end with a 503
        self.window_sequences = window_sequences  # sequences of one request in the engine at once
        self.log_prompts = log_prompts  # --enable-log-requests
        self.max_log_len = max_log_len

    def start(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        max_tokens_name: str = "max_tokens",
        constraint_source: str | None = None,
    ) -> Job:
        """Validate every prompt and start the first window of them on the engine, all or none; a refusal is the
        APIError naming the request's own field."""
        timer = RequestTimer(self.metrics)
        if self.log_prompts:
            self._log_received(request_id, prompts, params)
        streams: list[tuple[str, AsyncIterator[list[ChoiceDelta]]]] = []
        window = self.window(len(prompts), params.n)
        try:
            for p in prompts[window:]:  # started later, as earlier ones finish: checked now
                self.engine.validate(p.token_ids, p.params or params)
            for i, p in enumerate(prompts[:window]):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append((rid, self.engine.submit(rid, p.token_ids, p.params or params)))
        except Exception as e:
            for rid, _ in streams:
                self.engine.abort(rid)
            err = to_api_error(e)
            err.param = engine_param(err.param, constraint_source)
            if err.param == "max_tokens" and max_tokens_name != "max_tokens":
                err.param = max_tokens_name
                err.message = err.message.replace("'max_tokens'", f"'{max_tokens_name}'")
            raise err from e
        job = Job(request_id, prompts, params.n, streams, timer, params=params)
        job.pending.extend(range(window, len(prompts)))
        return job

    def window(self, prompts: int, n: int) -> int:
        """How many of a request's prompts run in the engine at once."""
        return min(prompts, max(1, self.window_sequences // n))

    async def _start_next(self, job: Job) -> None:
        """Start the next waiting prompt of `job`; while the engine's queue is full, wait for room (the request
        was accepted: it is not refused now)."""
        k = job.pending.popleft()
        rid = f"{job.request_id}-{k}"
        delay = 0.01
        while True:
            try:
                p = job.prompts[k]
                job.streams.append((rid, self.engine.submit(rid, p.token_ids, p.params or job.params)))
                return
            except EngineOverloadedError:
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.5)

    def _log_received(self, request_id: str, prompts: list[Prompt], params: SamplingParams) -> None:
        """vLLM's request log line: the prompt, the sampling parameters and the prompt's token ids."""
        cut = self.max_log_len
        for i, p in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            text = p.text if p.text is None or cut is None else p.text[:cut]
            ids = p.token_ids if cut is None else p.token_ids[:cut]
            logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", rid, text, params, ids)

    async def respond(self, raw: Request, req: SamplingFields, fmt: ResponseFormat) -> Response:
        """A started job as SSE (stream) or one JSON body."""
        if req.stream:
            return DisconnectAwareStream(self._events(fmt, req), media_type="text/event-stream")
        if not await self.run(raw, fmt.job):
            return JSONResponse({}, status_code=499)  # the client left (nginx's code); nobody reads this
        body = fmt.response()
        return JSONResponse(body if isinstance(body, dict) else dump(body))

    async def _events(self, fmt: ResponseFormat, req: SamplingFields) -> AsyncIterator[str]:
        """The server-sent events of a streaming response; always ends with [DONE] (after an error event if the
        request failed), unless the client is gone."""
        job = fmt.job
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = continuous_usage(req)
        outcome = "aborted"
        try:
            for chunk in fmt.opening():
                yield sse(chunk)
            async for d in self._until_drained(self._deltas(job)):
                body = fmt.chunk(d)
                job.states[d.index].absorb(d)
                if isinstance(body, list):  # a format whose delta is several typed events (/v1/responses)
                    for event in body:
                        yield sse(event)
                elif body is not None:
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

    async def run(self, raw: Request | None, job: Job) -> bool:
        """Run a started job to completion (its states hold the outcome); False when the client left first."""
        if raw is None:
            return await self._collect(job)
        return await run_until_disconnect(raw, self._collect(job))

    async def _collect(self, job: Job) -> bool:
        """Run to completion (the non-streaming responder's work); True when done."""
        outcome = "aborted"
        try:
            async for d in self._until_drained(self._deltas(job)):
                job.states[d.index].absorb(d)
            outcome = "ok"
            return True
        except Exception as e:
            outcome = "failed"
            raise to_api_error(e, job.request_id) from e
        finally:
            self._end(job, outcome)

    async def _until_drained(self, deltas: AsyncIterator[ChoiceDelta]) -> AsyncIterator[ChoiceDelta]:
        """`deltas`, until the server's shutdown grace period ends (then a 503 APIError)."""
        if self.draining is None:
            async for d in deltas:
                yield d
            return
        drained = asyncio.ensure_future(self.draining.wait())
        try:
            while True:
                step = asyncio.ensure_future(deltas.__anext__())
                await asyncio.wait({step, drained}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    step.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await step
                    raise APIError(SHUTDOWN_MESSAGE, 503)
                try:
                    d = step.result()
                except StopAsyncIteration:
                    return
                yield d
        finally:
            drained.cancel()

    async def _deltas(self, job: Job) -> AsyncIterator[ChoiceDelta]:
        """Every prompt's deltas as they arrive, with choice indexes over the whole request."""
        if len(job.prompts) == 1:
            async for deltas in job.streams[0][1]:
                self._arrived(job, 0, deltas)
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
        remaining = len(job.prompts)
        try:
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                    if job.pending:
                        await self._start_next(job)
                        tasks.append(asyncio.ensure_future(pump(len(job.streams) - 1, job.streams[-1][1])))
                    continue
                if isinstance(item, Exception):
                    raise item
                self._arrived(job, i, item)
                for d in item:
                    yield dataclasses.replace(d, index=i * job.n + d.index)
        finally:
            for t in tasks:
                t.cancel()

    def _arrived(self, job: Job, prompt: int, deltas: list[ChoiceDelta]) -> None:
        """Time and count what prompt `prompt`'s engine request just sent. The token counters grow as the engine
        works, as vLLM's do (its prompt once its first output came: the prefill is done), so the throughput line
        and /metrics show a long request while it runs, not all at its end."""
        count = sum(len(d.token_ids) for d in deltas)
        job.timer.tokens(count)
        job.metered_tokens += count
        if self.metrics:
            if prompt not in job.metered_prompts:
                self.metrics.prompt_tokens.inc(len(job.prompts[prompt].token_ids))
            if count:
                self.metrics.generation_tokens.inc(count)
        job.metered_prompts.add(prompt)

    def _end(self, job: Job, outcome: str) -> None:
        """Abort whatever still runs (idempotent: frees KV blocks on a disconnect), count and log the request."""
        for rid, _ in job.streams:
            self.engine.abort(rid)
        completion = job.completion_tokens
        if self.metrics:
            m = self.metrics
            # What `_arrived` has not counted yet: the prompts with no output (an abort before their first).
            m.prompt_tokens.inc(
                sum(len(p.token_ids) for i, p in enumerate(job.prompts) if i not in job.metered_prompts)
            )
            m.generation_tokens.inc(max(0, completion - job.metered_tokens))
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
