"""The engine adapter bound to the real engine: `cpuinfer.engine.async_llm.AsyncLLM`.

AsyncLLM runs the engine core (scheduler, model, sampler) in its own
process pinned to the inference cores; this process keeps HTTP and
tokenization, pinned to the reserved cores (VLLM_CPU_NUM_OF_RESERVED_CPU)
when there are any.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator

from cpuinfer.engine.limits import validate_request
from cpuinfer.engine.messages import EngineStats
from cpuinfer.entrypoints.openai.engine_adapter import ChoiceDelta, CoreState, EngineAdapter, TokenLogprob
from cpuinfer.entrypoints.openai.tokenization import Tokenization
from cpuinfer.errors import EngineDeadError
from cpuinfer.platform.topology import format_cpu_list
from cpuinfer.sampling_params import SamplingParams

logger = logging.getLogger("cpuinfer.server")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, exactly as the other commands define them (vLLM names)."""
    from cpuinfer.config import EngineArgs

    EngineArgs.add_cli_args(parser)


def _logprobs(entries) -> list[TokenLogprob] | None:
    """vLLM-style [{token_id: Logprob}] (sampled token included) -> TokenLogprob with ranked alternatives."""
    if entries is None:
        return None
    out = []
    for chosen_id, table in entries:
        top = sorted(((tid, lp) for tid, lp in table.items() if lp.rank is not None), key=lambda x: x[1].rank)
        chosen = table[chosen_id]
        out.append(TokenLogprob(chosen_id, chosen.logprob, [(tid, lp.logprob) for tid, lp in top], chosen.rank))
    return out


class AsyncLLMAdapter(EngineAdapter):
    """EngineAdapter over AsyncLLM (engine core in a child process)."""

    def __init__(self, engine, tokenization: Tokenization | None = None):
        self.engine = engine
        spec = engine.config.spec
        self.model_path = engine.config.model
        self.max_model_len = engine.max_model_len
        self.tokenization = tokenization or Tokenization(spec)
        self.limits = engine.limits
        self.generation_defaults = dict(getattr(spec, "generation_defaults", None) or {})
        self.dp_rank = engine.config.args.data_parallel_rank
        self.runner = engine.config.runner
        self.requests_routed = 0
        self.last_stats = EngineStats()
        self._shut = False

    @property
    def pid(self) -> int | None:
        """Process id of the engine core."""
        return self.engine.pid

    @property
    def healthy(self) -> bool:
        """The core process is alive and has not reported a failure."""
        return not self._shut and self.engine.dead_reason is None

    @property
    def dead(self) -> bool:
        """The core process exited, crashed or stopped answering."""
        return not self._shut and self.engine.dead_reason is not None

    def status_text(self) -> str:
        """Why the engine is not healthy."""
        if self._shut:
            return "shutting down"
        dead = self.engine.dead_reason
        return f"engine core died: {dead}" if dead else "ready"

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[list[ChoiceDelta]]:
        """Start a request now (validated by the engine) and return its deltas."""
        if not self.healthy:
            raise EngineDeadError(self.status_text())
        stream = self.engine.add_request(request_id, prompt_token_ids, params)
        self.requests_routed += 1
        return self._deltas(request_id, stream)

    async def _deltas(self, request_id: str, stream) -> AsyncIterator[list[ChoiceDelta]]:
        finished = False
        done_choices: set[int] = set()
        try:
            async for out in stream:
                deltas = []
                prompt_lps = None
                if out.prompt_logprobs is not None:
                    pairs = zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True)
                    prompt_lps = [None, *_logprobs(list(pairs))]
                for o in out.outputs:
                    if o.index in done_choices:
                        continue  # a finished choice is repeated while its siblings run; report it once
                    if o.finish_reason is not None:
                        done_choices.add(o.index)
                    lps = None
                    if o.logprobs is not None:
                        lps = _logprobs(list(zip(o.token_ids, o.logprobs, strict=False)))
                    delta = ChoiceDelta(
                        o.index, o.text, list(o.token_ids), lps, o.finish_reason, o.stop_reason, prompt_lps, out.pooled
                    )
                    if "accepted_prediction_tokens" in out.metrics:
                        m = out.metrics
                        delta.prediction_tokens = (m["accepted_prediction_tokens"], m["rejected_prediction_tokens"])
                    deltas.append(delta)
                finished = out.finished
                if deltas:
                    yield deltas
        finally:
            if not finished:
                # Synchronous on purpose: this runs inside a cancelled task, where awaiting is not possible.
                self.abort(request_id)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The engine's one request check (a constraint's compile is cached: the later submit looks it up)."""
        validate_request(prompt_token_ids, params, self.engine.limits, self.engine.grammars)

    def compile_constraint(self, constraint) -> None:
        """Into this core's grammar cache (the backend releases the GIL while it compiles)."""
        self.engine.grammars.compile(constraint)

    def abort(self, request_id: str) -> None:
        """Abort now (frees the request's KV blocks in the core); a no-op for a finished request."""
        self.engine.abort_nowait(request_id)

    async def stats(self) -> EngineStats:
        """The engine core's counters."""
        self.last_stats = await self.engine.get_stats()
        return self.last_stats

    def core_states(self) -> list[CoreState]:
        """This one core."""
        s = self.last_stats
        return [CoreState(self.dp_rank, not self.dead, self.requests_routed, s.num_running, s.num_waiting)]

    def describe(self) -> str:
        """'pid 123 on host: rank 0 -> cores 0-15 -> NUMA node 0': where the core and its tensor-parallel ranks
        run (the last ones in their own processes)."""
        from cpuinfer.platform.threads import describe_rank

        engine = self.engine
        where = f"pid {engine.pid} on {engine.host}" if engine.host else f"pid {engine.pid}"
        ranks = [describe_rank(r.rank, r.cpus, r.node) for r in engine.layout]
        return f"{where}: {'; '.join(ranks)}" if ranks else where

    async def shutdown(self) -> None:
        """Abort what is left and stop the core process."""
        self._shut = True
        await asyncio.to_thread(self.engine.shutdown)


def pin_front_end(inference_cpus: set[int]) -> None:
    """Move this process's threads off the inference cores, onto the reserved ones (if any are left)."""
    if not inference_cpus:
        return  # unbound cores: leave the OS to share them
    front = set(os.sched_getaffinity(0)) - inference_cpus
    if not front:
        return  # no reserved cores: share them (the OS schedules the light HTTP work in between)
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # the thread ended since listdir
            os.sched_setaffinity(int(tid), front)
    logger.info(
        "front end pinned to CPUs %s (inference cores: %s)",
        format_cpu_list(sorted(front)),
        format_cpu_list(sorted(inference_cpus)),
    )


def local_cpus(engines) -> set[int]:
    """The CPUs the ranks of these cores (AsyncLLMs) use on this machine."""
    import socket

    here = socket.gethostname()
    return {c for e in engines if e.host in ("", here) for r in e.layout for c in (r.cpus or [])}


def make_engine_starter(args: argparse.Namespace):
    """A coroutine function that starts the engine from the parsed flags (off the event loop) and adapts it:
    one AsyncLLM, or with -dp N (or the ray backend) N of them behind a DataParallelAdapter."""

    async def start() -> EngineAdapter:
        from cpuinfer.config import EngineArgs
        from cpuinfer.engine.async_llm import AsyncLLM

        engine_args = EngineArgs.from_cli_args(args)
        by_hand = getattr(args, "data_parallel_rank", None) is not None
        if by_hand and engine_args.data_parallel_backend == "ray":
            raise ValueError(
                "--data-parallel-rank runs one rank's engine core in this server; with --data-parallel-backend "
                "ray the server starts every rank itself: give only one of them"
            )
        if not by_hand and (engine_args.data_parallel_size > 1 or engine_args.data_parallel_backend == "ray"):
            from cpuinfer.entrypoints.openai.data_parallel import start_data_parallel

            return await start_data_parallel(engine_args)
        # Loading takes seconds: keep the loop free so /health can answer 503 meanwhile.
        engine = await asyncio.to_thread(AsyncLLM.from_engine_args, engine_args)
        adapter = AsyncLLMAdapter(engine)
        logger.info(
            "engine core process %s; %d KV blocks of %d tokens",
            adapter.describe(),
            engine.num_blocks,
            engine.config.block_size,
        )
        if engine_args.data_parallel_size > 1:
            logger.info(
                "data-parallel rank %d of %d (an external load balancer routes between the servers)",
                engine_args.data_parallel_rank,
                engine_args.data_parallel_size,
            )
        pin_front_end(local_cpus([engine]))
        return adapter

    return start
