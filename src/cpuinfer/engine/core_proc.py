"""The engine core in its own process: a loop that takes messages, steps the core and sends results.

The child binds its threads (VLLM_CPU_OMP_THREADS_BIND), loads the weights and
allocates the KV cache; the parent keeps only the tokenizer. While requests
are live the loop never blocks on the pipe; when idle it sleeps in recv().
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import socket
import threading
from dataclasses import dataclass

from cpuinfer.engine.messages import AbortRequests, AddRequest, GetStats, Heartbeat, Shutdown, StepResult

logger = logging.getLogger("cpuinfer.engine")


@dataclass
class Ready:
    """Sent once the model is loaded: the KV pool's size, and where the core's ranks run."""

    num_blocks: int
    layout: list  # worker.tp_executor.RankPlacement of each rank: pid, cpus, NUMA node
    host: str = ""  # the machine's name (Ray places cores on other machines)


@dataclass
class CoreFailed:
    """Sent when the core process dies of an exception: what failed, in one line (the traceback goes to
    the core's log, never to clients)."""

    message: str


class _Outbox:
    """The pipe to the front end, shared by the step loop and the heartbeat thread (a Connection is not
    thread-safe)."""

    def __init__(self, conn):
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, msg) -> None:
        """Send one message."""
        with self.lock:
            self.conn.send(msg)


def _beat(outbox: _Outbox, interval: float, stop: threading.Event) -> None:
    """Heartbeats until stopped or the front end is gone."""
    seq = 0
    while not stop.wait(interval):
        seq += 1
        try:
            outbox.send(Heartbeat(seq))
        except (OSError, ValueError):  # the front end closed the pipe: the step loop sees it too
            return


def core_main(config, inbox, conn) -> None:
    """Entry point of the core process."""
    # The parent owns the core's lifetime: a Ctrl-C reaches the whole process group, and a server must be able
    # to drain its in-flight requests before it sends Shutdown. If the parent dies, the pipe closes and we exit.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%m-%d %H:%M:%S"
    )
    run_core(config, inbox, conn)


def run_core(config, inbox, conn) -> None:
    """Load the core that `config` describes (an EngineConfig the front end resolved: the core never resolves the
    flags again), then step it and answer messages until Shutdown or the front end is gone.

    `inbox` has poll() and recv() (a pipe end, or a Ray actor's queue); `conn` has send(). Raises what killed
    the core after reporting it as CoreFailed.
    """
    outbox = _Outbox(conn)
    stop = threading.Event()
    try:
        from cpuinfer.engine.core import EngineCore

        core = EngineCore.from_config(config, warm_grammars=True)
        core.grammars.wait_warm()  # built before the first request, not during another's steps
        outbox.send(Ready(config.num_blocks, core.layout, socket.gethostname()))
        interval = min(1.0, float(config.args.engine_heartbeat_timeout) / 4)
        threading.Thread(target=_beat, args=(outbox, interval, stop), name="cpuinfer-heartbeat", daemon=True).start()
        while True:
            errors: dict[str, str] = {}
            while inbox.poll() or not core.has_unfinished():
                msg = inbox.recv()
                if isinstance(msg, AddRequest):
                    try:
                        core.add_request(msg)
                    except ValueError as exc:
                        errors[msg.request_id] = str(exc)
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
    finally:
        stop.set()


def start_core_process(config):
    """Spawn the core process of a resolved EngineConfig; returns (process, send end to it, receive end from it)."""
    ctx = mp.get_context("spawn")  # never fork a process that holds OpenMP threads
    to_core_r, to_core_w = ctx.Pipe(duplex=False)
    from_core_r, from_core_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=core_main, args=(config, to_core_r, from_core_w), name="cpuinfer-engine-core", daemon=True
    )
    proc.start()
    to_core_r.close()
    from_core_w.close()
    return proc, to_core_w, from_core_r
