"""An engine core as a Ray actor, and the front end's side of it (`--data-parallel-backend ray`).

Ray places and supervises the core; the core's messages do not travel through Ray. As in vLLM (whose Ray
engine-core actors talk ZeroMQ to the front end), the actor connects back to the front end over TCP and runs
the same loop as a core process (`core_proc.run_core`) on that connection: the front end's side has the shape
`core_proc.start_core_process` returns (a process-like handle, a sender, a receiver), so `AsyncLLM` drives an
actor exactly as it drives a child process, and a token costs what it costs over a pipe. (A first version
long-polled the actor with a Ray call per step: +2 ms per token at SmolLM2's 4.5 ms on 2 cores, the per-call
work of Ray's gRPC and the actor's threads competing with the core's OpenMP threads.)

The connection: a listening socket on this node's Ray address and a fresh port, one per core; the actor's
`serve(address, authkey, ...)` connects, both sides prove the 32-byte authkey (multiprocessing.connection's
HMAC challenge) before any pickled message crosses, then the core loads the model and sends Ready.

Death: `serve` runs for the core's whole life, so its ObjectRef fails (RayActorError) when the actor's process
or node is gone. The receiver watches it whenever the connection is idle, and turns the end of the connection
or of `serve` into CoreFailed with Ray's reason, which fails the core's in-flight requests as a dead child
process does. A node that stops answering without Ray noticing is caught by the heartbeats (they come over the
connection): AsyncLLM's --engine-heartbeat-timeout kills the actor. Importing this module needs no Ray.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge

from cpuinfer import envs
from cpuinfer.engine.core_proc import CoreFailed, Ready, run_core

logger = logging.getLogger("cpuinfer.engine")

IDLE_CHECK_S = 0.25  # how often an idle receiver asks Ray whether the actor still runs
CONNECT_TIMEOUT_S = 300.0  # for the actor to start (a runtime_env to set up, a busy node) and connect back
REASON_WAIT_S = 1.0  # for Ray to say why an actor whose connection closed is gone (failing its requests waits)


class EngineCoreActor:
    """The Ray actor (wrapped with ray.remote at launch): one engine core, run by `serve`."""

    def serve(self, address: tuple[str, int], authkey: bytes, config) -> None:
        """Connect to the front end at `address` and run the core loop on that connection until Shutdown or the
        front end is gone. A failure of the core was reported over the connection (CoreFailed) and logged."""
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
        conn = Client(address, authkey=authkey)
        try:
            run_core(config, conn, conn)
        except Exception:  # noqa: BLE001 - run_core logged it and sent CoreFailed: the actor just ends
            return
        finally:
            conn.close()


@dataclass
class RayCorePlace:
    """Where the launcher put one engine core: its placement group and the Ray node it landed on."""

    rank: int
    placement_group: object  # ray.util.placement_group.PlacementGroup
    node_id: str
    node_ip: str
    cpus: float  # the CPUs its bundle reserves


class RayCoreHandle:
    """The process-like view of an actor that AsyncLLM uses: pid, is_alive, exitcode, join, terminate, kill."""

    def __init__(self, actor, run, place: RayCorePlace):
        self.actor = actor
        self.run = run  # ObjectRef of the actor's `serve`: ready when the core loop ended or the actor died
        self.place = place
        self.pid: int | None = None  # the core's process id on its node, from Ready
        self.lost: str | None = None  # why the actor is gone
        self.stopping = False  # AsyncLLM.shutdown waits for the core loop to end (after sending Shutdown)
        self.stopped = False  # killed by us

    def is_alive(self) -> bool:
        """False once the actor was lost or killed."""
        return self.lost is None and not self.stopped

    @property
    def exitcode(self) -> int | None:
        """None while alive; 1 once lost or killed (Ray reports no exit code)."""
        return None if self.is_alive() else 1

    def ended(self) -> bool:
        """True once `serve` returned or failed."""
        import ray

        done, _ = ray.wait([self.run], timeout=0)
        return bool(done)

    def reason(self) -> str:
        """Why `serve` ended: Ray's error in one line, or that the core loop returned."""
        import ray

        try:
            ray.get(self.run, timeout=REASON_WAIT_S)
        except ray.exceptions.GetTimeoutError:
            return "its connection to this server closed"
        except ray.exceptions.RayError as exc:
            return f"{type(exc).__name__}: {_first_line(exc)}"
        return "its core loop ended"

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds for the core loop to end."""
        import ray

        self.stopping = True
        if self.is_alive():
            ray.wait([self.run], timeout=10.0 if timeout is None else timeout)

    def kill(self) -> None:
        """Kill the actor (no restart)."""
        import ray

        self.stopped = True
        try:
            ray.kill(self.actor, no_restart=True)
        except (ray.exceptions.RayError, ValueError):
            logger.debug("kill of engine core %d failed", self.place.rank, exc_info=True)

    terminate = kill


class _Receiver:
    """AsyncLLM's `recv` end: the connection's messages; its end, or the actor's, becomes CoreFailed."""

    def __init__(self, handle: RayCoreHandle, conn: Connection | None, failure: str | None = None):
        self.handle = handle
        self.conn = conn
        self.failure = failure  # the actor ended before it connected

    def recv(self):
        """The next message from the core (blocks)."""
        while self.failure is None:
            try:
                if self.conn.poll(IDLE_CHECK_S):
                    msg = self.conn.recv()
                    if isinstance(msg, Ready) and msg.layout:
                        self.handle.pid = msg.layout[0].pid
                    return msg
            except (EOFError, OSError):
                self.failure = self.handle.reason()
                break
            if self.handle.stopped:
                raise EOFError("the engine core actor was stopped")
            if self.handle.ended() and not self.conn.poll(0):
                self.failure = self.handle.reason()
        if self.handle.stopped or self.handle.stopping:  # (reason() waited for the loop's end: no race)
            raise EOFError("the engine core actor was stopped")
        place = self.handle.place
        self.handle.lost = self.failure
        return CoreFailed(
            f"data-parallel engine core {place.rank} (Ray actor, pid {self.handle.pid}, node {place.node_ip} "
            f"{place.node_id[:12]}) is gone: {self.failure}"
        )


class _Closed:
    """The sender of a core that never connected."""

    def send(self, msg) -> None:  # noqa: ARG002 - the sender interface
        """Nothing to send to."""
        raise OSError("the engine core never connected")


def _accept(server: socket.socket, authkey: bytes, handle: RayCoreHandle) -> Connection | None:
    """The actor's authenticated connection, or None if the actor ended first (or never came)."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    server.settimeout(IDLE_CHECK_S)
    while time.monotonic() < deadline:
        try:
            sock, _ = server.accept()
        except TimeoutError:
            if handle.ended():
                return None
            continue
        sock.settimeout(None)
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, authkey)
            answer_challenge(conn, authkey)
        except Exception:  # noqa: BLE001 - a stranger on the port (AuthenticationError, EOF): wait for the actor
            logger.warning(
                "refused a connection to engine core %d's port that failed authentication", handle.place.rank
            )
            conn.close()
            continue
        return conn
    return None


def _first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (Ray's are long)."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")


def engine_env() -> dict[str, str]:
    """The engine's variables set here (envs.ENGINE), for the actors' runtime_env: other nodes lack this shell's."""
    return {name: os.environ[name] for var in envs.ENGINE for name in var.names if name in os.environ}


def ray_core_starter(place: RayCorePlace):
    """A `start_core` for AsyncLLM that starts the core as an actor in `place`'s placement group, connected back
    to this process."""

    def start(config):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        authkey = secrets.token_bytes(32)
        server = socket.create_server((ray.util.get_node_ip_address(), 0))
        try:
            actor = (
                ray.remote(EngineCoreActor)
                .options(
                    name=f"cpuinfer-engine-core-{place.rank}-{os.getpid()}",
                    num_cpus=place.cpus,
                    max_restarts=0,  # a lost core stays lost: its requests failed, and its KV cache is gone
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=place.placement_group, placement_group_bundle_index=0
                    ),
                    runtime_env={"env_vars": engine_env()},
                )
                .remote()
            )
            handle = RayCoreHandle(actor, actor.serve.remote(server.getsockname()[:2], authkey, config), place)
            conn = _accept(server, authkey, handle)
        finally:
            server.close()
        if conn is None:
            reason = handle.reason() if handle.ended() else f"it did not connect within {CONNECT_TIMEOUT_S:.0f} s"
            handle.kill()
            handle.stopped = False  # the receiver reports the failure
            return handle, _Closed(), _Receiver(handle, None, reason)
        return handle, conn, _Receiver(handle, conn)

    return start
