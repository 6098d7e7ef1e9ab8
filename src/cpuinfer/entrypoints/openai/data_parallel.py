"""Data parallelism behind one API server: N engine cores (one AsyncLLM each), one request -> one core.

`-dp N` (backend mp): N core processes on this machine, core i with data_parallel_rank i, so that its threads
take the i-th share of the cores (VLLM_CPU_OMP_THREADS_BIND: `a|b|...` lists one share per rank; `auto`
gives each rank its NUMA node). `--data-parallel-backend ray`: the cores are Ray actors placed by
`engine.ray_placement` on the nodes of a Ray cluster; this process (on the head) keeps HTTP and tokenization.

Routing: `dp_router.PrefixAwareRouter` (least loaded, with prefix affinity). Aborts go to the core that has
the request.

A core that dies: its in-flight requests fail at once with EngineDeadError (HTTP 5xx, or an error event
in a stream), exactly as a single core's do; the other cores keep serving, new requests are routed around
it, and /health answers 503 "degraded" naming it, so that an orchestrator restarts the server when it
chooses while clients are still served. Dead cores are not restarted (their KV cache and requests are gone;
a restart of the server brings every core back). When every core is dead the server exits 1, as with one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator

from cpuinfer.engine.messages import EngineStats, merge_stats
from cpuinfer.entrypoints.openai.dp_router import NoLiveCoreError, PrefixAwareRouter
from cpuinfer.entrypoints.openai.engine_adapter import ChoiceDelta, CoreState, EngineAdapter
from cpuinfer.entrypoints.openai.engine_binding import AsyncLLMAdapter, local_cpus, pin_front_end
from cpuinfer.errors import EngineDeadError, EngineOverloadedError
from cpuinfer.sampling_params import SamplingParams

logger = logging.getLogger("cpuinfer.server")

STATS_TIMEOUT_S = 5.0


class DataParallelAdapter(EngineAdapter):
    """EngineAdapter over N engine cores (AsyncLLMAdapters, rank order)."""

    def __init__(self, cores: list[AsyncLLMAdapter], on_shutdown=None):
        first = cores[0]
        self.cores = cores
        self.model_path = first.model_path
        self.max_model_len = first.max_model_len
        self.tokenization = first.tokenization
        self.limits = first.limits
        self.generation_defaults = first.generation_defaults
        self.runner = first.runner
        config = first.engine.config
        self.router = PrefixAwareRouter(len(cores), config.block_size, min(c.engine.num_blocks for c in cores))
        self._where: dict[str, int] = {}  # request id -> rank, while it runs
        self._on_shutdown = on_shutdown  # releases what the launcher reserved (Ray placement groups)
        self._shut = False

    # ---- health -----------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """True while any core serves."""
        return not self._shut and any(c.healthy for c in self.cores)

    @property
    def dead(self) -> bool:
        """Every core has failed."""
        return not self._shut and all(c.dead for c in self.cores)

    def dead_cores(self) -> list[str]:
        """'rank 1 (engine core died: ...)' for each dead core."""
        return [f"rank {c.dp_rank} ({c.status_text()})" for c in self.cores if c.dead]

    def degraded(self) -> str | None:
        """Which cores are dead while others serve."""
        if self._shut or self.dead:
            return None
        gone = [c for c in self.cores if c.dead]
        if not gone:
            return None
        ranks = ", ".join(str(c.dp_rank) for c in gone)
        return (
            f"data-parallel engine core(s) {ranks} of {len(self.cores)} died; the other cores serve new "
            "requests (restart the server to bring them back; details in the server log)"
        )

    def status_text(self) -> str:
        """Why the engine is not healthy."""
        if self._shut:
            return "shutting down"
        if self.dead:
            return "every data-parallel engine core died: " + "; ".join(self.dead_cores())
        if self.degraded():
            return "degraded: dead data-parallel engine core " + "; ".join(self.dead_cores())
        return "ready"

    # ---- requests ---------------------------------------------------------------------------------
    def compile_constraint(self, constraint) -> None:
        """Into every core's cache: the router may pick any."""
        for c in self.cores:
            if c.healthy:
                c.compile_constraint(constraint)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Every core checks requests alike: ask the first."""
        self.cores[0].validate(prompt_token_ids, params)

    def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[list[ChoiceDelta]]:
        """Start the request on the core the router picks (another if that one turns out dead or full)."""
        loads: list[int | None] = [c.engine.num_unfinished_seqs() if c.healthy else None for c in self.cores]
        while True:
            try:
                rank = self.router.choose(prompt_token_ids, loads)
            except NoLiveCoreError:
                raise EngineDeadError(self.status_text()) from None
            try:
                stream = self.cores[rank].submit(request_id, prompt_token_ids, params)
            except EngineDeadError:  # died since the loads were read
                loads[rank] = None
                continue
            except EngineOverloadedError:  # its queue is full: another core's may not be (prefix affinity)
                loads[rank] = None
                if any(load is not None for load in loads):
                    continue
                raise
            self._where[request_id] = rank
            return self._tracked(request_id, rank, stream)

    async def _tracked(self, request_id: str, rank: int, stream) -> AsyncIterator[list[ChoiceDelta]]:
        done = False
        try:
            async for deltas in stream:
                yield deltas
            done = True
        finally:
            self._where.pop(request_id, None)
            if not done:
                # Synchronous, as the core's own stream does: this may run inside a cancelled task.
                self.cores[rank].abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort on the core that runs it."""
        rank = self._where.get(request_id)
        if rank is not None:
            self.cores[rank].abort(request_id)

    def rank_of(self, request_id: str) -> int | None:
        """The core a running request went to."""
        return self._where.get(request_id)

    # ---- stats ------------------------------------------------------------------------------------
    async def stats(self) -> EngineStats:
        """The live cores' stats, merged (dead cores' counters kept)."""
        live = [c for c in self.cores if c.healthy]
        if not live:
            raise EngineDeadError(self.status_text())
        answers = await asyncio.gather(
            *(asyncio.wait_for(asyncio.shield(c.stats()), STATS_TIMEOUT_S) for c in live), return_exceptions=True
        )
        # A core that died or did not answer in time keeps its last stats; anything else is a bug worth raising.
        for a in answers:
            if isinstance(a, BaseException) and not isinstance(a, (EngineDeadError, asyncio.TimeoutError)):
                raise a
        gone = [_counters_only(c.last_stats) for c in self.cores if not c.healthy]
        return merge_stats([c.last_stats for c in live], gone)

    def core_states(self) -> list[CoreState]:
        """Every core, rank order."""
        return [s for c in self.cores for s in c.core_states()]

    async def shutdown(self) -> None:
        """Stop every core."""
        self._shut = True
        await asyncio.gather(*(c.shutdown() for c in self.cores), return_exceptions=True)
        if self._on_shutdown is not None:
            await asyncio.to_thread(self._on_shutdown)


def _counters_only(s: EngineStats) -> EngineStats:
    """A dead core's stats: its cumulative counters, nothing in its (gone) queues and pool."""
    return dataclasses.replace(s, num_running=0, num_waiting=0, num_kv_blocks=0, num_free_kv_blocks=0)


async def start_data_parallel(engine_args) -> DataParallelAdapter:
    """Start data_parallel_size engine cores (processes, or Ray actors) and put them behind one adapter."""
    from cpuinfer.engine.async_llm import AsyncLLM
    from cpuinfer.engine.core_proc import start_core_process

    # Every flag resolved and checked once, here, before any core starts (a bad -dp is one clear error, not N);
    # each core gets this config with its own rank, and never resolves the flags again.
    config = await asyncio.to_thread(engine_args.create_engine_config, True)
    dp = engine_args.data_parallel_size
    ray_backend = engine_args.data_parallel_backend == "ray"
    release = None
    if ray_backend:
        from cpuinfer.engine import ray_placement
        from cpuinfer.engine.ray_core import ray_core_starter

        places = await asyncio.to_thread(ray_placement.place_engine_cores, dp)
        release = lambda: ray_placement.release(places)  # noqa: E731 - a one-line closure
        starters = [ray_core_starter(p) for p in places]
        local = ray_placement.local_ranks(places)
        core_configs = [
            config.for_data_parallel_rank(p.rank, lr, ls) for p, (lr, ls) in zip(places, local, strict=True)
        ]
        for p, (lr, ls) in zip(places, local, strict=True):
            logger.info(
                "data-parallel rank %d: Ray node %s (%s), bundle of %g CPUs, local rank %d of %d there",
                p.rank,
                p.node_id[:12],
                p.node_ip,
                p.cpus,
                lr,
                ls,
            )
    else:
        starters = [start_core_process] * dp
        core_configs = [config.for_data_parallel_rank(rank) for rank in range(dp)]
    # Loading takes seconds per core: start them side by side, off the event loop (/health answers meanwhile).
    results = await asyncio.gather(
        *(asyncio.to_thread(AsyncLLM, c, s) for c, s in zip(core_configs, starters, strict=True)),
        return_exceptions=True,
    )
    failed = [(rank, r) for rank, r in enumerate(results) if isinstance(r, BaseException)]
    if failed:
        for r in results:
            if not isinstance(r, BaseException):
                await asyncio.to_thread(r.shutdown)
        if release is not None:
            await asyncio.to_thread(release)
        rank, exc = failed[0]
        # ValueError: a flag or variable the core refused, which _load reports as one line.
        kind = ValueError if isinstance(exc, ValueError) else RuntimeError
        raise kind(f"data-parallel engine core {rank} failed to start: {exc}") from exc
    first = AsyncLLMAdapter(results[0])
    cores = [first] + [AsyncLLMAdapter(e, first.tokenization) for e in results[1:]]
    for c in cores:
        logger.info(
            "data-parallel rank %d: engine core process %s; %d KV blocks", c.dp_rank, c.describe(), c.engine.num_blocks
        )
    logger.info(
        "data parallel: %d engine cores (%s backend) behind this server; routing: least loaded, prefix-aware",
        dp,
        engine_args.data_parallel_backend,
    )
    pin_front_end(local_cpus(results))
    return DataParallelAdapter(cores, release)
