"""ASGI middleware in front of every route but the probes: the in-flight request limit, the request body read
whole under a size and a time limit, and the body's cheap bounds (request_bounds.py) checked before the routes
parse and validate it.

The probes (/health, /ping) bypass all of it, so an orchestrator sees a healthy server even while the request
limit is reached. The body is read here (and replayed to the app) so that a chunked body over the limit gets the
same 413 as one with a Content-Length, and a client that never finishes its body is answered 408 instead of holding
a request slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from cpuinfer.entrypoints.openai.errors import APIError, error_response
from cpuinfer.entrypoints.openai.prep_pool import release_heap
from cpuinfer.entrypoints.openai.request_bounds import SCORING_ROUTES, RequestBounds, check_body

logger = logging.getLogger("cpuinfer.server")

PROBE_ROUTES = ("/health", "/ping")
CHECKED_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/tokenize",
    *SCORING_ROUTES,
)
LARGE_BODY = 1024 * 1024  # bytes: after requests this large, freed heap is given back to the OS


@dataclass(frozen=True)
class GuardConfig:
    """The guard's limits (the `serve` flags')."""

    max_body_bytes: int = 8 * 1024 * 1024
    body_timeout: float = 30.0  # seconds to receive a whole body
    limit_concurrency: int | None = None  # in-flight requests, probes not counted
    bounds: RequestBounds = field(default_factory=RequestBounds)


def route_path(scope) -> str:
    """The path the routes match: uvicorn puts --root-path in front of it (as the ASGI spec asks)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :] or "/"
    return path


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


class RequestGuard:
    """The in-flight limit, the body's size and time limits, and its cheap bounds (see the module doc)."""

    def __init__(self, app, config: GuardConfig, char_limits: Callable[[], tuple[int | None, int | None]]):
        self.app = app
        self.config = config
        self.char_limits = char_limits  # (per prompt, per request), (None, None) while the model loads
        self.in_flight = 0
        self._large_seen = False  # a body over LARGE_BODY was read since the heap was last released

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or route_path(scope) in PROBE_ROUTES:
            return await self.app(scope, receive, send)
        cfg = self.config
        if cfg.limit_concurrency is not None and self.in_flight >= cfg.limit_concurrency:
            msg = (
                f"The server is at its limit of {cfg.limit_concurrency} requests in flight (--limit-concurrency); "
                "retry shortly."
            )
            return await error_response(msg, 503, headers={"Retry-After": "1"})(scope, receive, send)
        self.in_flight += 1
        try:
            await self._guarded(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0 and self._large_seen:
                self._large_seen = False
                release_heap()  # a multi-MB body's parse left its pages in the allocator: give them back

    async def _guarded(self, scope, receive, send):
        cfg = self.config
        limit = cfg.max_body_bytes
        too_big = f"Request body too large: the limit is {limit} bytes (--max-request-body-bytes)."
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await error_response(too_big, 413)(scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read_body(receive, limit), cfg.body_timeout)
        except _TooLarge:
            return await error_response(too_big, 413)(scope, receive, send)
        except (TimeoutError, asyncio.TimeoutError):
            msg = f"The request body did not arrive within {cfg.body_timeout:g} s (--http-body-timeout)."
            return await error_response(msg, 408, headers={"Connection": "close"})(scope, receive, send)
        except _Disconnected:
            return None
        if body:
            try:
                parsed = json.loads(body)
            except ValueError:
                parsed = None  # the route's own parser says what is wrong with it
            except RecursionError:
                msg = "The request body is JSON nested too deeply to decode; no field of this API needs it."
                return await error_response(msg, 400)(scope, receive, send)
            try:
                route = route_path(scope)
                if route in CHECKED_ROUTES:
                    check_body(route, parsed, cfg.bounds, *self.char_limits())
            except APIError as e:
                return await e.response()(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only http.disconnect comes

        await self.app(scope, replay, send)

    async def _read_body(self, receive, limit: int) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > LARGE_BODY:
                self._large_seen = True
            if size > limit:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
