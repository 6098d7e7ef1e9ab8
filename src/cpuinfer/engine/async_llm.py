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
    engine.config.spec.encode_chat(messages) -> (text, ids); engine.max_model_len; engine.model_name
    engine.shutdown()

Breaking out of `async for` early aborts the request too, and so does a stream
dropped without `aclose()` (its KV blocks are freed when it is collected).

Failures, and who they reach:
- a request the engine cannot start raises `InvalidRequestError` from
  `add_request`; `EngineOverloadedError` when --max-waiting-requests sequences
  already wait;
- a request that fails inside the engine (sampler, detokenizer, a kernel's
  Python error) raises `RequestFailedError` from its stream; the engine and
  every other request go on;
- a failure of the engine itself (the core process exits, crashes, or answers
  no heartbeat within --engine-heartbeat-timeout) raises `EngineDeadError`
  from every open stream and every later call.

The event loop never blocks on the core: messages to it go through a writer
thread, messages from it through a reader thread.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import socket
import threading
import time
import weakref

from cpuinfer.config import EngineArgs, EngineConfig
from cpuinfer.engine.core_proc import CoreFailed, Ready, start_core_process
from cpuinfer.engine.limits import RequestLimits, validate_request
from cpuinfer.engine.messages import AbortRequests, EngineStats, GetStats, Heartbeat, Shutdown, StepResult
from cpuinfer.engine.output_processor import OutputProcessor
from cpuinfer.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, RequestFailedError
from cpuinfer.outputs import RequestOutput
from cpuinfer.sampling_params import SamplingParams
from cpuinfer.structured.manager import StructuredOutputManager

logger = logging.getLogger("cpuinfer.engine")

__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream"]


class RequestStream:
    """Async iterator over one request's RequestOutputs."""

    def __init__(self, engine: AsyncLLM, request_id: str):
        # Weak: a stream dropped without aclose() must be collectable so that __del__ can abort it.
        self._engine = weakref.ref(engine)
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
            if item.error_id is not None:
                raise RequestFailedError(self.request_id, item.error_id, item.error_reason, item.error_param)
        return item

    async def aclose(self) -> None:
        """Stop listening; aborts the request if it is still running."""
        if not self.done:
            self.done = True
            engine = self._engine()
            if engine is not None:
                engine.abort_nowait(self.request_id)

    def __del__(self):
        # Dropped without aclose() while its request runs: abort it so its KV blocks are freed. The
        # collector may run this on any thread, so the abort is handed to the engine's event loop.
        if self.done:
            return
        engine = self._engine()
        if engine is not None:
            engine.abort_soon(self.request_id)


class AsyncLLM:
    """Front end of an out-of-process engine core."""

    def __init__(self, config: EngineConfig, start_core=start_core_process):
        # `config` was resolved and checked once, in this process (no weights read): the core process, its
        # tensor/pipeline-parallel ranks and a Ray actor get it as it is and never resolve the flags again.
        self.config = config
        args = config.args
        self.tokenizer = self.config.spec.tokenizer
        self.max_model_len = self.config.max_model_len
        self.limits = RequestLimits.from_config(self.config)
        spec = self.config.spec
        # Compiles each new constraint once here too, so a bad schema is a 400 before the request is sent on.
        self.grammars = StructuredOutputManager(
            args.structured_outputs_backend, spec.tokenizer, spec.vocab_size, spec.eos_token_ids
        )
        if config.pooler is None:
            self.grammars.warm_up()  # while the core loads: its build holds this process's GIL
        self.model_name = args.model or os.path.basename(self.config.model)
        self.max_queued_seqs = self.config.max_num_seqs + args.max_waiting_requests
        self.heartbeat_timeout = float(args.engine_heartbeat_timeout)
        self.processor = OutputProcessor(self.tokenizer)
        # Weak: the caller owns a stream; one it drops is collected, and its __del__ aborts the request.
        self._streams: weakref.WeakValueDictionary[str, RequestStream] = weakref.WeakValueDictionary()
        self._stats_waiters: list[asyncio.Future] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: str | None = None
        self._closing = False
        # `start_core` starts the core somewhere (a child process here, or a Ray actor: engine.ray_core) and
        # returns (a process-like handle, a sender to it, a receiver from it).
        self._proc, self._to_core, self._from_core = start_core(config)
        first = self._from_core.recv()
        if isinstance(first, CoreFailed):
            self._proc.join(5)
            raise EngineDeadError(f"the engine core failed to start: {first.message}")
        if not isinstance(first, Ready):
            raise EngineDeadError(f"the engine core sent {type(first).__name__} before it was ready")
        self.num_blocks = first.num_blocks
        self.layout = first.layout  # RankPlacement per rank of the core (rank 0 is the core process)
        self.host = first.host  # the core's machine
        dp = f"data-parallel rank {args.data_parallel_rank}: " if args.data_parallel_size > 1 else ""
        where = f" on {first.host}" if first.host and first.host != socket.gethostname() else ""
        for placement in self.layout:
            logger.info("%sengine core %s%s", dp, placement.describe(), where)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._last_heard = time.monotonic()
        self._threads = [
            threading.Thread(target=self._read_loop, name="cpuinfer-core-reader", daemon=True),
            threading.Thread(target=self._write_loop, name="cpuinfer-core-writer", daemon=True),
            threading.Thread(target=self._heartbeat_loop, name="cpuinfer-core-heartbeat", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, serving: bool = True, start_core=start_core_process) -> AsyncLLM:
        """Resolve the flags here (bad ones fail in this process), start the core process and wait until the model
        is loaded."""
        return cls(args.create_engine_config(serving=serving), start_core)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, prompt: str | None = None
    ) -> RequestStream:
        """Start a request; returns its async stream. Raises InvalidRequestError at once if it breaks a
        limit, EngineOverloadedError if the waiting queue is full, EngineDeadError if the engine is gone."""
        self._check_alive()
        self._loop = asyncio.get_running_loop()  # where outputs are delivered (the caller's loop)
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        validate_request(prompt_token_ids, sampling_params, self.limits, self.grammars)
        queued = self.num_unfinished_seqs()
        if queued + sampling_params.n > self.max_queued_seqs:
            raise EngineOverloadedError(
                f"The server is at capacity: {queued} sequences are running or waiting "
                f"(--max-num-seqs + --max-waiting-requests = {self.max_queued_seqs}); "
                "retry shortly."
            )
        stream = RequestStream(self, request_id)
        msg = self.processor.add_request(request_id, prompt, list(prompt_token_ids), sampling_params)
        self._streams[request_id] = stream
        self._send(msg)
        return stream

    def num_unfinished_seqs(self) -> int:
        """Sequences (samples) of requests that are running or waiting."""
        return sum(state.params.n for state in self.processor.states.values())

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str):
        """Convenience: tokenize a text prompt and yield the request's outputs."""
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else list(prompt)
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
        """Abort without awaiting (usable from a cancelled task or a finally block; on the loop's thread)."""
        ids = self.processor.child_ids(request_id)
        if ids and self._dead is None:
            self._send(AbortRequests(ids))
        final = self.processor.abort(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and final is not None:
            stream.queue.put_nowait(final)

    def abort_soon(self, request_id: str) -> None:
        """Abort from any thread (the garbage collector's, say): done on the event loop's thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self.abort_nowait, request_id)
        except RuntimeError:  # the loop closed in between: nothing is listening any more
            logger.debug("abort of %s dropped: the event loop is closed", request_id)

    async def get_stats(self) -> EngineStats:
        """Counters of the engine core."""
        self._check_alive()
        self._loop = asyncio.get_running_loop()  # where outputs are delivered (the caller's loop)
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
            self._send(Shutdown())
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
        self._outbox.put(None)

    # ---- plumbing -------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        """Queue a message for the core; never blocks (a stopped core must not freeze the event loop)."""
        self._outbox.put(msg)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _write_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self._to_core.send(msg)
            except (OSError, BrokenPipeError, ValueError):  # the core is gone; the reader reports it
                if self._closing:
                    return

    def _heartbeat_loop(self) -> None:
        """Watch the core's heartbeats; if nothing arrives for heartbeat_timeout seconds, it is hung: kill it."""
        interval = min(1.0, self.heartbeat_timeout / 4)
        while not self._closing and self._dead is None:
            time.sleep(interval)
            silent = time.monotonic() - self._last_heard
            if silent > self.heartbeat_timeout and self._proc.is_alive() and not self._closing:
                reason = (
                    f"the engine core (pid {self._proc.pid}) answered nothing for {silent:.0f}s "
                    f"(--engine-heartbeat-timeout={self.heartbeat_timeout:g}); it is hung or stopped, "
                    "and was killed"
                )
                logger.error("%s", reason)
                try:
                    self._proc.kill()
                except OSError:
                    logger.debug("could not kill the engine core", exc_info=True)
                self._report(CoreFailed(reason))
                return

    def _read_loop(self) -> None:
        while True:
            try:
                msg = self._from_core.recv()
            except (EOFError, OSError):
                if self._closing:
                    return
                code = self._proc.exitcode
                if code is None:
                    self._proc.join(1)
                    code = self._proc.exitcode
                msg = CoreFailed(f"the engine core process exited (code {code})")
            self._last_heard = time.monotonic()
            if isinstance(msg, Heartbeat):
                continue
            self._report(msg)
            if isinstance(msg, CoreFailed):
                return

    def _report(self, msg) -> None:
        """Hand a message to the event loop (or, before there is one, remember a failure)."""
        if isinstance(msg, CoreFailed) and self._dead is not None:
            return  # already reported
        if self._loop is None:
            if isinstance(msg, CoreFailed):
                self._dead = msg.message
            return  # nothing can be waiting yet
        try:
            self._loop.call_soon_threadsafe(self._dispatch, msg)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            if isinstance(msg, CoreFailed):
                self._dead = msg.message

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
            for rid, message in msg.errors.items():  # refused by the core (rare: checked here first)
                logger.warning("the engine core refused request %s: %s", rid, message)
                self.abort_nowait(rid)
        elif isinstance(msg, EngineStats):
            # A waiter whose caller gave up (cancelled by a timeout) is skipped, not answered.
            while self._stats_waiters:
                fut = self._stats_waiters.pop(0)
                if not fut.done():
                    fut.set_result(msg)
                    break
        elif isinstance(msg, CoreFailed):
            if self._dead is not None and self._dead != msg.message:
                return
            self._dead = msg.message
            err = EngineDeadError(msg.message)
            for stream in list(self._streams.values()):
                stream.queue.put_nowait(err)
            self._streams.clear()
            for fut in self._stats_waiters:
                if not fut.done():
                    fut.set_exception(err)
            self._stats_waiters.clear()
