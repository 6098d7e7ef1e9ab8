"""OpenAI-shaped errors: one exception type, the map from engine errors to HTTP, and the handlers that
render every failure as ``{"error": {"message", "type", "param", "code"}}`` with the fitting status.

Client-facing messages never carry a traceback or a file path: an unexpected failure answers with an
error id, and the log holds the details under the same id."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cpuinfer.entrypoints.openai.protocol import ErrorResponse, dump
from cpuinfer.errors import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    RequestFailedError,
    new_error_id,
)

logger = logging.getLogger("cpuinfer.server")

# vLLM's spelling of the error type for each status.
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    422: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """A request failure with its HTTP status and the offending field, if any."""

    def __init__(
        self, message: str, status: int = 400, param: str | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers

    def body(self) -> dict:
        """The OpenAI error body."""
        return error_body(self.message, self.status, self.param)

    def response(self) -> JSONResponse:
        """The error as an HTTP response."""
        return error_response(self.message, self.status, self.param, self.headers)


def _sampling_param(message: str) -> str | None:
    """The field a SamplingParams error names ("SamplingParams.top_p=2 is invalid: ...")."""
    prefix = "SamplingParams."
    if message.startswith(prefix):
        return message[len(prefix) :].split("=", 1)[0] or None
    return None


def to_api_error(exc: BaseException, request_id: str | None = None) -> APIError:
    """The HTTP error for an engine error (one map for every route; the engine owns the rules)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(exc.message, 400, exc.param)
    if isinstance(exc, (ValueError, TypeError)):
        # SamplingParams checks its fields with ValueError (TypeError: a field it does not know).
        return APIError(str(exc), 400, _sampling_param(str(exc)))
    if isinstance(exc, EngineOverloadedError):
        return APIError(str(exc), 503, headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, RequestFailedError):
        if exc.reason is not None:  # the request's own fault (found while generating): a client error
            return APIError(exc.reason, 400, exc.param)
        return APIError(
            f"Internal error while generating (error id {exc.error_id}); the server log has the "
            "details. Other requests are unaffected; retry.",
            500,
        )
    if isinstance(exc, EngineDeadError):
        what = "while running the request" if request_id else "before the request could start"
        return APIError(f"The engine is not running: it failed {what}. Retry on another replica.", 503)
    error_id = new_error_id()
    logger.error("internal error (error id %s) in request %s", error_id, request_id or "-", exc_info=exc)
    return APIError(f"Internal server error (error id {error_id}); the server log has the details.", 500)


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """The JSON body of an error with this status."""
    type_ = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return dump(ErrorResponse.make(message, type_, status, param))


def error_response(
    message: str, status: int, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """A JSONResponse carrying an OpenAI error body."""
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


def describe_validation_errors(errors: list[dict]) -> tuple[str, str | None]:
    """One readable message (naming each field and what it needs) and the first field's name."""
    parts: list[str] = []
    params: list[str] = []
    seen = set()
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        kind = err.get("type", "")
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if kind == "json_invalid":
            ctx = err.get("ctx") or {}
            parts.append(f"request body is not valid JSON ({ctx.get('error', msg)})")
            params.append(None)
            continue
        # Union members each report; keep the field path without the union branch tags.
        # A union of models (the /tokenize body) tags the path with the model's name: CamelCase, unlike fields.
        field = (
            ".".join(
                x
                for x in loc
                if not x.startswith(("function-", "list[", "str", "int", "float"))
                and x not in ("constrained-int", "constrained-float")
                and not (x[:1].isupper() and x.isalnum())
            )
            or None
        )
        if kind == "missing":
            text = f"field '{field}' is required" if field else "a required field is missing"
        elif kind == "extra_forbidden":
            text = f"'{field}' is not supported by this server; remove it"
        else:
            text = f"{field}: {msg}" if field else msg
        if text in seen:
            continue
        seen.add(text)
        parts.append(text)
        params.append(field)
        if len(parts) >= 3:
            break
    if not parts:
        return "invalid request body", None
    return "; ".join(parts), next((p for p in params if p), None)


def install_error_handlers(app: FastAPI) -> None:
    """Make every failure (validation, unknown route, bug) answer with an OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = describe_validation_errors(list(exc.errors()))
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        if exc.status_code == 404 and detail == "Not Found":
            detail = "Not Found: no such route; see /openapi.json for the API"
        return error_response(detail, exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        return to_api_error(exc).response()
