"""The engine core in its own process: a loop that takes messages, steps the core and sends results.

The child binds its threads (VLLM_CPU_OMP_THREADS_BIND), loads the weights and
allocates the KV cache; the parent keeps only the tokenizer. While requests
are live the loop never blocks on the pipe; when idle it sleeps in recv().
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
from dataclasses import dataclass

from cpuinfer.engine.messages import AbortRequests, AddRequest, GetStats, Ping, Pong, Shutdown, StepResult

logger = logging.getLogger("cpuinfer.engine")


@dataclass
class Ready:
    """Sent once the model is loaded."""

    num_blocks: int


@dataclass
class CoreFailed:
    """Sent when the core process dies of an exception: what failed, in one line (the traceback goes to
    the core's log, never to clients)."""

    message: str


def core_main(args, serving: bool, inbox, outbox) -> None:
    """Entry point of the core process."""
    # The parent owns the core's lifetime: a Ctrl-C reaches the whole process group, and a server must be able
    # to drain its in-flight requests before it sends Shutdown. If the parent dies, the pipe closes and we exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%m-%d %H:%M:%S")
    try:
        from cpuinfer.engine.core import EngineCore

        config = args.create_engine_config(serving=serving)
        core = EngineCore.from_config(config)
        outbox.send(Ready(config.num_blocks))
        while True:
            errors: dict[str, str] = {}
            while inbox.poll() or not core.has_unfinished():
                msg = inbox.recv()
                if isinstance(msg, AddRequest):
                    try:
                        core.add_request(msg)
                    except ValueError as exc:
                        errors[msg.request_id] = str(exc)
                elif isinstance(msg, Ping):
                    outbox.send(Pong(msg.seq))
                elif isinstance(msg, AbortRequests):
                    core.abort(msg.request_ids)
                elif isinstance(msg, GetStats):
                    outbox.send(core.stats())
                elif isinstance(msg, Shutdown):
                    return
            outputs = core.step()
            if outputs or errors:
                outbox.send(StepResult(outputs, errors))
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        return
    except BaseException as exc:  # report, then die
        logger.critical("the engine core failed and exits", exc_info=exc)
        try:
            outbox.send(CoreFailed(f"{type(exc).__name__}: {exc}"))
        except (OSError, ValueError):
            logger.debug("could not report the failure: the front end is gone", exc_info=True)
        raise


def start_core_process(args, serving: bool):
    """Spawn the core process; returns (process, send end to it, receive end from it)."""
    ctx = mp.get_context("spawn")  # never fork a process that holds OpenMP threads
    to_core_r, to_core_w = ctx.Pipe(duplex=False)
    from_core_r, from_core_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=core_main, args=(args, serving, to_core_r, from_core_w), name="cpuinfer-engine-core",
                       daemon=True)
    proc.start()
    to_core_r.close()
    from_core_w.close()
    return proc, to_core_w, from_core_r
