"""uvicorn's h11 protocol with a reverse proxy's connection defaults: a connection must send a request's headers
within --http-header-timeout (nginx's client_header_timeout; uvicorn has none, so a client sending nothing, or a
byte a second, held its connection forever), and at most --max-idle-connections connections without a request in
progress stay open: past that the longest-idle one is closed. Idle connections so no longer count against the
request limit (guard.py counts requests, not connections), and cannot crowd out /health or anyone's requests.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11Protocol(H11Protocol):
    """H11Protocol plus the header timeout and the idle-connection cap (set by `guarded_protocol`)."""

    header_timeout: float = 10.0
    max_idle: int = 1024
    # This server's idle connections, longest-idle first (O(1) to keep and to trim, even with thousands open).
    idle: ClassVar[OrderedDict[GuardedH11Protocol, None]] = OrderedDict()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Arm the header timer; close the longest-idle connection if there are now too many idle ones."""
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()
        self._mark_idle()

    def _mark_idle(self) -> None:
        self.idle[self] = None
        self.idle.move_to_end(self)
        while len(self.idle) > self.max_idle:
            oldest, _ = self.idle.popitem(last=False)
            oldest._close_idle()

    def _busy(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if not self._busy():
            self._close_idle()

    def _close_idle(self) -> None:
        self._cancel_header_timer()
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        """Once a request's headers are in, its connection is no longer idle: stop the header timer."""
        super().handle_events()
        if self._busy():
            self._cancel_header_timer()
            self.idle.pop(self, None)

    def on_response_complete(self) -> None:
        """Idle again: the next request's headers have --http-header-timeout to arrive."""
        if not self.transport.is_closing():
            self._arm_header_timer()
            self._mark_idle()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the header timer."""
        self._cancel_header_timer()
        self.idle.pop(self, None)
        super().connection_lost(exc)


def guarded_protocol(header_timeout: float, max_idle: int) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn should use (its `http` setting), with these limits."""
    return type(
        "ConfiguredH11Protocol",
        (GuardedH11Protocol,),
        {"header_timeout": header_timeout, "max_idle": max_idle, "idle": OrderedDict()},
    )
