"""OpenAI-shaped errors: one exception type and the handlers that render every failure as
``{"error": {"message", "type", "param", "code"}}`` with the fitting HTTP status."""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cpuinfer.entrypoints.openai.protocol import ErrorResponse, dump

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

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """The JSON body of an error with this status."""
    type_ = ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return dump(ErrorResponse.make(message, type_, status, param))


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    """A JSONResponse carrying an OpenAI error body."""
    return JSONResponse(error_body(message, status, param), status_code=status)


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
        field = ".".join(x for x in loc if not x.startswith(("function-", "list[", "str", "int", "float"))
                         and x not in ("constrained-int", "constrained-float")) or None
        if kind == "missing":
            text = f"field '{field}' is required" if field else "a required field is missing"
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
        return error_response(exc.message, exc.status, exc.param)

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
        logger.exception("internal error while serving a request")
        return error_response(f"internal server error: {type(exc).__name__}: {exc}", 500)
