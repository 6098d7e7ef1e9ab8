"""`AsyncLLM`: the asyncio client of an engine core running in its own process (for `cpuinfer serve`).

The HTTP server and tokenization stay in the caller's process; the core
(scheduler, model, sampler) runs in a child process pinned to the inference
cores, and the two exchange the dataclasses of `cpuinfer.engine.messages`
over multiprocessing pipes.

API (all from inside one running asyncio loop)::

    engine = AsyncLLM.from_engine_args(EngineArgs(model=...))   # blocks until the model is loaded
    tok = engine.tokenizer                                      # tokenizers.Tokenizer
    ids = engine.encode("Hello")                                # or tokenize yourself
    stream = engine.add_request("req-1", ids, SamplingParams(max_tokens=32,
                                output_kind=RequestOutputKind.DELTA))
        # validates now: raises ValueError (prompt too long, max_tokens overflows the context,
        # bad logprobs, duplicate id) before any work; other requests are unaffected
    async for out in stream:        # RequestOutput, incremental per output_kind (CUMULATIVE/DELTA/FINAL_ONLY)
        print(out.outputs[0].text, out.finished)
    await engine.abort("req-1")     # the stream then ends with finish_reason "abort"
    stats = await engine.get_stats()  # EngineStats: num_running, num_waiting, kv_cache_usage,
                                      # prefix_cache_hit_rate, num_preemptions, prompt/generation tokens
    engine.apply_chat_template(messages) -> str; engine.max_model_len; engine.model_name
    engine.shutdown()

Breaking out of `async for` early aborts the request too. If the core process
dies, every open stream raises `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import os
import threading

from cpuinfer.config import EngineArgs
from cpuinfer.engine.core import validate_request
from cpuinfer.engine.core_proc import CoreFailed, Ready, start_core_process
from cpuinfer.engine.messages import AbortRequests, EngineStats, GetStats, Shutdown, StepResult
from cpuinfer.engine.output_processor import OutputProcessor
from cpuinfer.outputs import RequestOutput
from cpuinfer.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine core process exited."""


class RequestStream:
    """Async iterator over one request's RequestOutputs."""

    def __init__(self, engine: AsyncLLM, request_id: str):
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finished:
            self.done = True
        return item

    async def aclose(self) -> None:
        """Stop listening; aborts the request if it is still running."""
        if not self.done:
            self.done = True
            await self.engine.abort(self.request_id)

    def __del__(self):
        if not self.done and self.engine is not None:
            try:
                self.engine._abort_nowait(self.request_id)
            except Exception:
                pass


class AsyncLLM:
    """Front end of an out-of-process engine core."""

    def __init__(self, args: EngineArgs, serving: bool = True):
        # Resolve and check everything here first (no weights are read), so bad flags fail in this process.
        self.config = args.create_engine_config(serving=serving)
        self.tokenizer = self.config.spec.tokenizer
        self.max_model_len = self.config.max_model_len
        self.model_name = args.model or os.path.basename(self.config.model)
        self.processor = OutputProcessor(self.tokenizer)
        self._streams: dict[str, RequestStream] = {}
        self._stats_waiters: list[asyncio.Future] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None
        self._closing = False
        self._proc, self._to_core, self._from_core = start_core_process(args, serving)
        first = self._from_core.recv()
        if isinstance(first, CoreFailed):
            self._proc.join(5)
            raise EngineDeadError(f"the engine core failed to start: {first.message}")
        assert isinstance(first, Ready)
        self.num_blocks = first.num_blocks
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read_loop, name="cpuinfer-core-reader", daemon=True)
        self._reader.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, serving: bool = True) -> AsyncLLM:
        """Start the core process and wait until the model is loaded."""
        return cls(args, serving)

    # ---- helpers for the server -----------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a text."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The model's chat template applied to messages."""
        return self.config.spec.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                    prompt: str | None = None) -> RequestStream:
        """Start a request; returns its async stream. Raises ValueError at once if it breaks a limit."""
        self._check_alive()
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        validate_request(prompt_token_ids, sampling_params, self.max_model_len, self.config.spec.vocab_size,
                         self.config.args.max_logprobs)
        stream = RequestStream(self, request_id)
        msgs = self.processor.add_request(request_id, prompt, list(prompt_token_ids), sampling_params)
        self._streams[request_id] = stream
        for m in msgs:
            self._send(m)
        return stream

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str):
        """Convenience: tokenize a text prompt and yield the request's outputs."""
        text = prompt if isinstance(prompt, str) else None
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        stream = self.add_request(request_id, ids, sampling_params, text)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason 'abort'."""
        self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """Abort without awaiting (usable from a cancelled task or a finally block)."""
        ids = self.processor.child_ids(request_id)
        if ids and self._dead is None:
            self._send(AbortRequests(ids))
        final = self.processor.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and final is not None:
            stream.queue.put_nowait(final)

    async def get_stats(self) -> EngineStats:
        """Counters of the engine core."""
        self._check_alive()
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        fut = self._loop.create_future()
        self._stats_waiters.append(fut)
        self._send(GetStats())
        return await fut

    @property
    def pid(self) -> int | None:
        """Process id of the engine core."""
        return self._proc.pid

    @property
    def dead_reason(self) -> str | None:
        """Why the engine core failed, or None while it is healthy."""
        if self._dead is None and not self._closing and not self._proc.is_alive():
            return f"engine core process exited (code {self._proc.exitcode})"
        return self._dead

    def shutdown(self) -> None:
        """Stop the core process."""
        self._closing = True
        if self._proc.is_alive():
            try:
                self._send(Shutdown())
            except (OSError, BrokenPipeError):
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)

    # ---- plumbing -------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        with self._send_lock:
            self._to_core.send(msg)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self._from_core.recv()
            except (EOFError, OSError):
                if self._closing:
                    return
                msg = CoreFailed("the engine core process exited")
            if self._loop is None:
                if isinstance(msg, CoreFailed):
                    self._dead = msg.message
                    return
                continue  # nothing can be waiting yet
            try:
                self._loop.call_soon_threadsafe(self._dispatch, msg)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
                return
            if isinstance(msg, CoreFailed):
                return

    def _dispatch(self, msg) -> None:
        if isinstance(msg, StepResult):
            outs, to_abort = self.processor.process(msg.outputs)
            if to_abort:
                self._send(AbortRequests(to_abort))
            for out in outs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.queue.put_nowait(out)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
            for rid, _message in msg.errors.items():  # a child the core refused (rare: checked here first)
                parent = next((s for s in self._streams if rid == s or rid.endswith("_" + s)), None)
                if parent is not None:
                    self.abort_nowait(parent)
        elif isinstance(msg, EngineStats):
            # A waiter whose caller gave up (cancelled by a timeout) is skipped, not answered.
            while self._stats_waiters:
                fut = self._stats_waiters.pop(0)
                if not fut.done():
                    fut.set_result(msg)
                    break
        elif isinstance(msg, CoreFailed):
            self._dead = msg.message
            err = EngineDeadError(msg.message)
            for stream in self._streams.values():
                stream.queue.put_nowait(err)
            self._streams.clear()
            for fut in self._stats_waiters:
                if not fut.done():
                    fut.set_exception(err)
            self._stats_waiters.clear()
