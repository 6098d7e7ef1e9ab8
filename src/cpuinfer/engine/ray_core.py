"""An engine core as a Ray actor, and the front end's side of it (`--data-parallel-backend ray`).

The actor runs the same loop as the core process (`core_proc.run_core`) in a thread, with two in-memory
mailboxes where the process has pipes. The front end's side has the shape `core_proc.start_core_process`
returns (a process-like handle, a sender, a receiver), so `AsyncLLM` drives an actor exactly as it drives a
child process. Importing this module needs no Ray; `ray_core_starter` imports it.

The protocol is two actor methods, each called from one of AsyncLLM's plumbing threads (never the event loop):
- `put(messages)`, by the writer thread: AddRequest / AbortRequests / GetStats / Shutdown. The writer waits for
  each put before the next, which keeps their order (a threaded actor may run concurrent calls in any order).
- `take(timeout)`, by the reader thread: a long poll that returns every message the core sent since the last
  take (Ready, StepResult, EngineStats, Heartbeat, CoreFailed), as soon as there is one, or [] after `timeout`.
  A busy core is drained once per take, so one round trip carries as many steps as happened since the last.

Death: Ray fails the pending take of an actor whose process or node is gone (RayActorError); the receiver
turns that into CoreFailed, which fails the core's in-flight requests as a dead child process does. A node that
stops answering without Ray noticing is caught by the heartbeats (they come through take too): AsyncLLM's
--engine-heartbeat-timeout kills the actor.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from dataclasses import dataclass

from cpuinfer import envs
from cpuinfer.engine.core_proc import CoreFailed, Ready, run_core

logger = logging.getLogger("cpuinfer.engine")

TAKE_POLL_S = 1.0  # a take returns at the latest after this long (heartbeats arrive more often than that)
JOIN_GRACE_S = 5.0  # beyond a join's own timeout, for the call to come back


class _Mailbox:
    """A thread-safe queue with a pipe end's poll() / recv() / send(), and drain() for take."""

    def __init__(self):
        self._items: collections.deque = collections.deque()
        self._cv = threading.Condition()

    def send(self, msg) -> None:
        """Queue one message."""
        with self._cv:
            self._items.append(msg)
            self._cv.notify_all()

    def poll(self) -> bool:
        """True if a message is waiting."""
        return bool(self._items)

    def recv(self):
        """The next message (blocks until there is one)."""
        with self._cv:
            while not self._items:
                self._cv.wait()
            return self._items.popleft()

    def drain(self, timeout: float) -> list:
        """Everything queued, waiting up to `timeout` seconds for the first message."""
        with self._cv:
            if not self._items:
                self._cv.wait(timeout)
            out = list(self._items)
            self._items.clear()
            return out


class EngineCoreActor:
    """The Ray actor: an engine core stepping in a thread of its own (wrapped with ray.remote at launch)."""

    def __init__(self, args, serving: bool):
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
        self.inbox, self.outbox = _Mailbox(), _Mailbox()
        self.thread = threading.Thread(target=self._run, args=(args, serving), name="cpuinfer-core", daemon=True)
        self.thread.start()

    def _run(self, args, serving: bool) -> None:
        try:
            run_core(args, serving, self.inbox, self.outbox)
        except BaseException:  # noqa: BLE001 - run_core logged it and sent CoreFailed; the thread just ends
            return

    def put(self, messages: list) -> None:
        """Hand messages to the core loop, in order."""
        for msg in messages:
            self.inbox.send(msg)

    def take(self, timeout: float) -> list:
        """The core's messages since the last take (waits up to `timeout` seconds for one)."""
        return self.outbox.drain(timeout)

    def join(self, timeout: float) -> bool:
        """Wait for the core loop to end (after Shutdown); True if it did."""
        self.thread.join(timeout)
        return not self.thread.is_alive()


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

    def __init__(self, actor, place: RayCorePlace):
        self.actor = actor
        self.place = place
        self.pid: int | None = None  # the actor's process id on its node, from Ready
        self.lost: str | None = None  # why Ray says the actor is gone
        self.stopped = False  # killed by us

    def is_alive(self) -> bool:
        """False once the actor was lost or killed."""
        return self.lost is None and not self.stopped

    @property
    def exitcode(self) -> int | None:
        """None while alive; 1 once lost or killed (Ray reports no exit code)."""
        return None if self.is_alive() else 1

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds for the core loop to end."""
        import ray

        if not self.is_alive():
            return
        wait = 10.0 if timeout is None else timeout
        try:
            ray.get(self.actor.join.remote(wait), timeout=wait + JOIN_GRACE_S)
        except ray.exceptions.RayError:
            logger.debug("join of engine core %d failed", self.place.rank, exc_info=True)

    def kill(self) -> None:
        """Kill the actor (no restart)."""
        import ray

        self.stopped = True
        try:
            ray.kill(self.actor, no_restart=True)
        except (ray.exceptions.RayError, ValueError):
            logger.debug("kill of engine core %d failed", self.place.rank, exc_info=True)

    terminate = kill


class _Sender:
    """AsyncLLM's `send` end: one put per message, waited for (keeps the order)."""

    def __init__(self, handle: RayCoreHandle):
        self.handle = handle

    def send(self, msg) -> None:
        """Deliver one message; OSError if the actor is gone (AsyncLLM's writer treats that as a closed pipe)."""
        import ray

        try:
            ray.get(self.handle.actor.put.remote([msg]))
        except ray.exceptions.RayError as exc:
            raise OSError(f"engine core {self.handle.place.rank} is unreachable: {type(exc).__name__}") from exc


class _Receiver:
    """AsyncLLM's `recv` end: long polls the actor's take; a lost actor becomes CoreFailed."""

    def __init__(self, handle: RayCoreHandle):
        self.handle = handle
        self.buffer: collections.deque = collections.deque()

    def recv(self):
        """The next message from the core (blocks)."""
        import ray

        while not self.buffer:
            if self.handle.stopped:
                raise EOFError("the engine core actor was stopped")
            try:
                self.buffer.extend(ray.get(self.handle.actor.take.remote(TAKE_POLL_S)))
            except ray.exceptions.RayError as exc:
                if self.handle.stopped:
                    raise EOFError("the engine core actor was stopped") from exc
                place = self.handle.place
                self.handle.lost = _first_line(exc)
                return CoreFailed(
                    f"data-parallel engine core {place.rank} (Ray actor, pid {self.handle.pid}, node "
                    f"{place.node_ip} {place.node_id[:12]}) is gone: {type(exc).__name__}: {self.handle.lost}"
                )
        msg = self.buffer.popleft()
        if isinstance(msg, Ready) and msg.layout:
            self.handle.pid = msg.layout[0].pid
        return msg


def _first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (Ray's are long)."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")


def engine_env() -> dict[str, str]:
    """The engine's variables set here (envs.ENGINE), for the actors' runtime_env: other nodes lack this shell's."""
    return {name: os.environ[name] for var in envs.ENGINE for name in var.names if name in os.environ}


def ray_core_starter(place: RayCorePlace):
    """A `start_core` for AsyncLLM that starts the core as an actor in `place`'s placement group."""

    def start(args, serving: bool):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = (
            ray.remote(EngineCoreActor)
            .options(
                name=f"cpuinfer-engine-core-{place.rank}-{os.getpid()}",
                num_cpus=place.cpus,
                max_concurrency=4,  # put, take and join run beside each other (the core steps in its own thread)
                max_restarts=0,  # a lost core stays lost: its requests failed, and its KV cache is gone
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=place.placement_group, placement_group_bundle_index=0
                ),
                runtime_env={"env_vars": engine_env()},
            )
            .remote(args, serving)
        )
        handle = RayCoreHandle(actor, place)
        return handle, _Sender(handle), _Receiver(handle)

    return start
