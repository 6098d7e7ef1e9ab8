"""Every 4xx answer is logged at info level with its request id and reason, so that an operator can see why
a client fails (the client sees the same reason in the error body, and the id in the X-Request-Id header).

A pure ASGI middleware around the whole app: it sees the answers of the routes, of the validation and
error handlers, and of the auth / body-limit middleware alike, and passes every byte through unchanged."""

from __future__ import annotations

import json
import logging
import uuid

logger = logging.getLogger("cpuinfer.server")

MAX_LOGGED_BODY = 4096  # an error body is small; a 4xx with a large body is logged by its first bytes


class LogClientErrors:
    """ASGI middleware: log each 4xx response (method, path, client, request id, the error's message)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1") or f"req-{uuid.uuid4().hex}"
        status = 0
        body = bytearray()

        async def watching_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if 400 <= status < 500:
                    sent = list(message.get("headers", []))
                    if all(k.lower() != b"x-request-id" for k, _ in sent):
                        message = {**message, "headers": [*sent, (b"x-request-id", request_id.encode())]}
            elif message["type"] == "http.response.body" and 400 <= status < 500:
                if len(body) < MAX_LOGGED_BODY:
                    body.extend(message.get("body", b"")[: MAX_LOGGED_BODY - len(body)])
                if not message.get("more_body", False):
                    client = scope.get("client") or ("-", 0)
                    logger.info(
                        "%d %s %s from %s (request id %s): %s",
                        status,
                        scope["method"],
                        scope["path"],
                        client[0],
                        request_id,
                        reason(bytes(body)),
                    )
            await send(message)

        return await self.app(scope, receive, watching_send)


def reason(body: bytes) -> str:
    """The message of an OpenAI error body, else the body's text."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace") or "(no body)"
