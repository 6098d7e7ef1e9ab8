"""The errors cpuinfer raises to its callers, one class per concept, with one common base.

The engine raises them; the entry points map them to what their users see
(the server to HTTP statuses, the CLI to one line and an exit code).
"""

from __future__ import annotations

import uuid


class CpuinferError(Exception):
    """Base of every error cpuinfer raises on purpose (EnvError, in envs.py, stays a plain ValueError: the
    build backend loads that file on its own, without this package)."""


class IsaError(CpuinferError, RuntimeError):
    """No usable kernel variant, or a forced one this machine cannot run."""


class ModelLoadError(CpuinferError, ValueError):
    """A model file is missing, corrupt, or describes something cpuinfer does not support."""


class InvalidRequestError(CpuinferError, ValueError):
    """A request breaks a limit or names something invalid; nothing of it was started.

    `param` names the offending request field (OpenAI's error `param`), when there is one.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class EngineOverloadedError(CpuinferError):
    """The engine's waiting queue is full; retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class EngineDeadError(CpuinferError, RuntimeError):
    """The engine core is gone (exited, crashed or stopped answering); no request can finish."""


class EngineBrokenError(CpuinferError, RuntimeError):
    """Inside the engine core: no request can run any more (a broken model or kernel, a tensor-parallel rank
    gone); the core process exits with this message, and its front end raises EngineDeadError."""


class RequestFailedError(CpuinferError, RuntimeError):
    """One request failed inside the engine; the engine and every other request go on.

    The message is safe to show to a client (no traceback, no paths); the details are in the
    engine's log under the same `error_id`.
    """

    def __init__(self, request_id: str, error_id: str, reason: str | None = None, param: str | None = None):
        super().__init__(
            reason
            or f"request {request_id} failed inside the engine (error id {error_id}); the server log has the details"
        )
        self.request_id = request_id
        self.error_id = error_id
        # Set when the request itself is what cannot be served (its constraint cannot be followed by this
        # model): a client error, shown as is, naming `param`. None: the engine's fault (a 500).
        self.reason = reason
        self.param = param


def new_error_id() -> str:
    """A short id that ties a client-facing error to its log entry."""
    return "err-" + uuid.uuid4().hex[:12]
