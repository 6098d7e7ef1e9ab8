"""The ranks of one engine core: rank 0 in the core's own process, ranks 1..N-1 in worker processes.

`RankExecutor` (also importable as `TPExecutor`) stands where a `ModelRunner` stands in the engine core
(`execute(seqs) -> logits`). There are tp x pp ranks; rank r is pipeline stage r // tp and tensor-parallel
rank r % tp within it. The scheduler runs once, in the core; each step's scheduled sequences go to every
worker through its pipe. The ranks of a stage run the same forward pass on their share of its layers'
weights and KV heads, meeting in their stage's shared-memory all-reduces (`cpuinfer.distributed.shm`);
the stages hand micro-batches on to each other (`cpuinfer.distributed.pipeline`). Rank 0 ends with the
full logits and samples them.

Each rank binds its threads and memory first (`VLLM_CPU_OMP_THREADS_BIND`, rank = its global index among
the data-parallel x tensor-parallel x pipeline-parallel ranks of this machine), then loads the weights, so
its share is allocated on its own NUMA node.

Failure: a worker that dies makes rank 0's next all-reduce fail within the communicator's timeout checks
(a dead peer's pid is noticed within milliseconds); the executor then raises `EngineBrokenError` naming the
rank, and the engine core exits with that message. Workers exit when rank 0's pipe closes or when rank 0
dies in a collective. A step that fails on rank 0 after the workers started it leaves the ranks out of
step, so it is fatal too; steps are checked (`ModelRunner.check`) before they are sent.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass

from cpuinfer import envs
from cpuinfer.errors import EngineBrokenError

logger = logging.getLogger("cpuinfer.distributed")

STARTUP_TIMEOUT_S = 600.0  # loading a large checkpoint on a busy machine


@dataclass
class RankPlacement:
    """Where one rank runs: its process, its CPUs (None = unbound) and NUMA node, its pipeline stage."""

    rank: int
    pid: int
    cpus: list[int] | None
    node: int | None
    stage: int | None = None  # pipeline stage (None without pipeline parallelism)

    def describe(self) -> str:
        """'rank 1 -> cores 16-31 -> NUMA node 1 (pid 123)': platform.threads' line, as `cpuinfer info` shows it,
        with ', pp stage 1' after the pid under pipeline parallelism."""
        from cpuinfer.platform.threads import describe_rank

        stage = "" if self.stage is None else f", pp stage {self.stage}"
        return f"{describe_rank(self.rank, self.cpus, self.node)} (pid {self.pid}{stage})"


@dataclass
class _Failed:
    rank: int
    message: str


def _connect(config, rank: int, name: str, watch: tuple[int, ...]):
    """This rank's communicators: (TPGroup of its stage, PPStage with its links to the neighbouring stages).

    Every rank opens them in the same order (its stage's, the previous stage's link, the next stage's link,
    the logits' link), so the blocking constructors meet without a cycle."""
    from cpuinfer.distributed.pipeline import MIN_MICRO_TOKENS, P2P_TIMEOUT_S, PPStage, stage_layers
    from cpuinfer.distributed.shm import ShmCommunicator
    from cpuinfer.distributed.tensor_parallel import TPGroup

    tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    stage, t = divmod(rank, tp)

    def label(r: int) -> str:  # a member's name in the communicators' errors
        return f"rank {r} (pp stage {r // tp})" if tp == 1 else f"rank {r} (tp rank {r % tp}, pp stage {r // tp})"

    tp_labels = tuple(label(stage * tp + i) for i in range(tp)) if pp > 1 else ()
    comm = ShmCommunicator(f"{name}t{stage}", t, tp, watch=watch, labels=tp_labels) if tp > 1 else None
    group = TPGroup(t, tp, comm)
    if pp == 1:
        return group, PPStage()
    try:

        def link(first: int, second: int, me: int, suffix: str):
            # A two-member link between global ranks first (member 0, who names it) and second (member 1).
            members = (label(first), label(second))
            return ShmCommunicator(
                f"{name}{suffix}{first}", me, 2, timeout_s=P2P_TIMEOUT_S, watch=watch, labels=members
            )

        prev = link(rank - tp, rank, 1, "p") if stage > 0 else None
        nxt = link(rank, rank + tp, 0, "p") if stage < pp - 1 else None
        logits = None
        if rank == 0:
            logits = link((pp - 1) * tp, 0, 1, "l")
        elif stage == pp - 1 and t == 0:
            logits = link(rank, 0, 0, "l")
        start, end = stage_layers(config.spec.num_layers, pp, stage)
        forced = envs.PP_MICRO_BATCHES.get()  # set: that many micro-batches whatever the step's size
        min_tokens = 1 if forced else MIN_MICRO_TOKENS
        return group, PPStage(stage, pp, start, end, prev, nxt, logits, forced or pp, min_tokens)
    except BaseException:
        if group.comm is not None:
            group.comm.close()
        raise


def _build_rank(config, rank: int, comm_name: str, watch: tuple[int, ...]):
    """Bind, attach to the communicators, load this rank's share; returns (runner, binding). watch: the pids
    whose exit ends the wait for the other ranks (rank 0: its workers; a worker: rank 0), so that a rank that
    dies before it attaches fails the start at once, not after the communicators' timeouts."""
    from cpuinfer.platform.threads import bind_from_env
    from cpuinfer.worker.model_runner import ModelRunner

    par = config.parallel
    binding = bind_from_env(par.global_rank(rank), par.machine_ranks)
    tp, pp = _connect(config, rank, comm_name, watch)
    try:
        runner = ModelRunner(config.spec, config.block_size, config.num_blocks, config.cache_dtype, tp, pp)
    except BaseException:
        _close(tp, pp)
        raise
    return runner, binding


def _close(tp, pp) -> None:
    """Close every communicator of a rank (peers waiting on it fail at once)."""
    for comm in (tp.comm, *pp.comms()):
        if comm is not None:
            comm.close()


def _placement(config, rank: int, binding) -> RankPlacement:
    par = config.parallel
    stage = rank // par.tensor_parallel_size if par.pipeline_parallel_size > 1 else None
    return RankPlacement(rank, os.getpid(), binding.cpus, binding.node, stage)


def _worker_main(config, rank: int, comm_name: str, conn) -> None:
    """Entry point of rank `rank` >= 1: build, report, then run every step rank 0 sends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core decides when ranks stop
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(asctime)s rank-{rank}: %(message)s")
    try:
        runner, binding = _build_rank(config, rank, comm_name, (os.getppid(),))
        conn.send(_placement(config, rank, binding))
    except BaseException as exc:  # report, then die
        logger.critical("rank %d failed to start", rank, exc_info=exc)
        with contextlib.suppress(OSError):
            conn.send(_Failed(rank, f"{type(exc).__name__}: {exc}"))
        return
    try:
        while True:
            seqs = conn.recv()
            if seqs is None:
                return
            runner.execute(seqs, checked=True)
    except (EOFError, OSError, KeyboardInterrupt):
        return  # rank 0 is gone
    except BaseException:
        logger.critical("rank %d failed in a step and exits", rank, exc_info=True)
        raise
    finally:
        _close(runner.tp, runner.pp)


class RankExecutor:
    """Runs every step on all tensor x pipeline-parallel ranks; `execute` returns rank 0's logits."""

    def __init__(self, config):
        from cpuinfer.distributed.shm import unique_name
        from cpuinfer.platform.threads import describe_layout

        self.size = config.world_size
        self.workers: list[tuple[mp.Process, object]] = []
        describe_layout(config.parallel.machine_ranks)  # a binding no rank can take fails here, once, before any starts
        name = unique_name()
        ctx = mp.get_context("spawn")  # never fork a process that holds OpenMP threads
        for rank in range(1, self.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main, args=(config, rank, name, child), name=f"cpuinfer-rank-{rank}", daemon=True
            )
            _start(proc)
            child.close()
            self.workers.append((proc, parent))
        try:
            self.runner, binding = _build_rank(config, 0, name, tuple(p.pid for p, _ in self.workers))
            self.layout = [_placement(config, 0, binding), *self._wait_ready()]
        except BaseException as exc:
            dead = self.dead_ranks()
            self.shutdown()
            if dead and not isinstance(exc, KeyboardInterrupt):
                raise RuntimeError(f"parallel {dead} while starting (its log above says why)") from exc
            raise
        for r in self.layout:
            logger.info("%s", r.describe())

    @property
    def spec(self):
        """The model's spec (as ModelRunner.spec)."""
        return self.runner.spec

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.runner.block_size

    @property
    def num_blocks(self) -> int:
        """KV blocks of every rank."""
        return self.runner.num_blocks

    def _wait_ready(self) -> list[RankPlacement]:
        ready = []
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, (proc, conn) in enumerate(self.workers, start=1):
            while not conn.poll(0.2):
                if not proc.is_alive():
                    raise RuntimeError(f"rank {rank} exited with code {proc.exitcode} while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {rank} did not start within {STARTUP_TIMEOUT_S:.0f} s")
            msg = conn.recv()
            if isinstance(msg, _Failed):
                raise RuntimeError(f"rank {rank} failed to start: {msg.message}")
            ready.append(msg)
        return ready

    def check(self, seqs) -> None:
        """As ModelRunner.check."""
        self.runner.check(seqs)

    def execute(self, seqs):
        """Run one step on every rank; rank 0's float32 logits."""
        if seqs:
            self.runner.check(seqs)  # a bad step raises here, before any rank starts it
        try:
            for _, conn in self.workers:
                conn.send(seqs)
            return self.runner.execute(seqs, checked=True)
        except Exception as exc:
            dead = self.dead_ranks()
            what = f"parallel {dead}" if dead else f"a parallel step failed on rank 0 ({exc})"
            raise EngineBrokenError(f"{what}; the ranks are out of step and the engine stops") from exc

    def dead_ranks(self) -> str:
        """'rank 1 (pid 123) exited with code -9', for each worker that is gone, or ''."""
        gone = [
            f"rank {r} (pid {p.pid}) exited with code {p.exitcode}"
            for r, (p, _) in enumerate(self.workers, start=1)
            if not p.is_alive()
        ]
        return ", ".join(gone)

    def shutdown(self) -> None:
        """Stop the workers (a second call does nothing)."""
        for _, conn in self.workers:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc, _ in self.workers:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.workers = []
        runner = getattr(self, "runner", None)
        if runner is not None:
            _close(runner.tp, runner.pp)

    def __del__(self):
        self.shutdown()


TPExecutor = RankExecutor  # its name before pipeline parallelism


def build_runner(config):
    """(runner, layout) of an engine core: its one rank bound here and a ModelRunner, or a RankExecutor over
    tensor x pipeline-parallel ranks (each bound in its own process, this one as rank 0)."""
    if config.world_size > 1:
        runner = RankExecutor(config)
        return runner, runner.layout
    from cpuinfer.platform.threads import bind_from_env
    from cpuinfer.worker.model_runner import ModelRunner

    binding = bind_from_env(config.parallel.global_rank(0), config.parallel.machine_ranks)
    pooling = config.pooler is not None
    runner = ModelRunner(config.spec, config.block_size, config.num_blocks, config.cache_dtype, pooling=pooling)
    return runner, [_placement(config, 0, binding)]


def _start(proc: mp.Process) -> None:
    """proc.start() from inside the engine core process, which is itself a daemon of the front end.

    multiprocessing refuses children of a daemonic process, because they would be orphaned when it is
    terminated; ours are not: each worker exits as soon as rank 0's pipe closes or its pid is gone (the
    communicator checks). So the flag is lifted for the start only.
    """
    me = mp.current_process()
    was = me._config.get("daemon")
    me._config["daemon"] = False
    try:
        proc.start()
    finally:
        me._config["daemon"] = was
