"""Every failure as an HTTP answer: the right status, OpenAI's error body (Anthropic's on
``/v1/messages``), and never a stack trace or a filesystem path.

==============================  ======  =====================================
error                           status  why
==============================  ======  =====================================
a body that does not validate    400     the field and what is wrong with it
UnsupportedParameter             400     the backend cannot honour the field
ContextLengthExceeded            400     the prompt does not fit the window
ConfigError (bad prompt, ...)    400
UnknownModel                     404     the aliases the server has
Busy                             429     queue full; Retry-After says when
load failures (OutOfMemory, ...) 503     the model cannot be loaded now
EngineClosed                     503     the model was unloaded meanwhile
GenerationError, anything else   500     logged in full, answered briefly
==============================  ======  =====================================
"""

from __future__ import annotations

import logging
import re
import secrets
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from unillm._errors import (
    BackendUnavailable,
    ConfigError,
    ContextLengthExceeded,
    EngineClosed,
    ModelLoadError,
    NoSuitableBackend,
    OutOfMemory,
    UnillmError,
    UnsupportedParameter,
)
from unillm.server._pool import Busy, ShuttingDown, UnknownModel

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["anthropic_type", "error_response", "install", "public_message", "shutting_down", "to_api_error"]

log = logging.getLogger("unillm.server")

# An absolute path: a slash not preceded by a word character, then path characters.
_PATH = re.compile(r"(?<![\w.~])(?:~|/)[\w.\-~+@%]*(?:/[\w.\-~+@%]*)+|(?<![\w])[A-Za-z]:\\[^\s'\"]+")
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    408: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
    503: "overloaded_error",
}  # fmt: skip


class ApiError(Exception):
    """An HTTP error answer: status, message, and the OpenAI ``type`` / ``param`` / ``code``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}


def public_message(exc: BaseException, paths: dict[str, str] | None) -> str:
    """``exc``'s message with each served model's path shown as its alias, any other path elided."""
    text = str(exc)
    for path, alias in (paths or {}).items():
        text = text.replace(path, alias)
    return _PATH.sub("<path>", text)[:2000]


def to_api_error(exc: BaseException, paths: dict[str, str] | None = None) -> ApiError:
    """The HTTP answer for one of unillm's errors."""
    if isinstance(exc, ApiError):
        exc.message = public_message(exc, paths)
        return exc
    msg = public_message(exc, paths)
    if isinstance(exc, UnknownModel):
        return ApiError(404, msg, param="model", code="model_not_found")
    if isinstance(exc, ShuttingDown):
        return shutting_down()
    if isinstance(exc, Busy):
        retry = {"Retry-After": str(exc.retry_after_s)}
        return ApiError(429, msg, type_="rate_limit_error", code="rate_limit_exceeded", headers=retry)
    if isinstance(exc, UnsupportedParameter):
        return ApiError(400, msg, param=exc.params[0] if exc.params else None, code="unsupported_parameter")
    if isinstance(exc, ContextLengthExceeded):
        return ApiError(400, msg, code="context_length_exceeded")
    if isinstance(exc, (OutOfMemory, ModelLoadError, BackendUnavailable, NoSuitableBackend)):
        return ApiError(
            503, "the model cannot be loaded now: " + msg, type_="server_error", code="model_unavailable",
            headers={"Retry-After": "30"},
        )  # fmt: skip
    if isinstance(exc, EngineClosed):
        return ApiError(503, msg, type_="server_error", headers={"Retry-After": "1"})
    if isinstance(exc, ConfigError):  # a validation that named one field says which
        return ApiError(400, msg, param=exc.fields[0] if len(exc.fields) == 1 else None)
    log.error("request failed", exc_info=exc)
    return ApiError(500, "the server failed to answer this request; see its log", type_="server_error")


def anthropic_type(status: int) -> str:
    """The Anthropic error ``type`` for an HTTP status."""
    return _ANTHROPIC_TYPES.get(status, "api_error")


def shutting_down() -> ApiError:
    """The answer to a request that arrives, waits or still runs once the server is stopping."""
    return ApiError(
        503, str(ShuttingDown()),
        type_="server_error", code="server_shutting_down",
        headers={"Retry-After": "5", "Connection": "close"},
    )  # fmt: skip


def error_response(request: Request | None, err: ApiError) -> JSONResponse:
    """OpenAI's error body, or Anthropic's for the Messages route."""
    path = request.url.path if request is not None else ""
    if path.startswith("/v1/messages"):
        # Anthropic's body has no param: the message names the field instead
        named = err.param is not None and not err.message.startswith(err.param)
        message = f"{err.param}: {err.message}" if named else err.message
        body: dict[str, Any] = {
            "type": "error",
            "error": {"type": anthropic_type(err.status), "message": message},
            "request_id": "req_" + secrets.token_hex(12),  # Anthropic's answers carry one
        }
    else:
        # a refusal without a more precise code is about the value of what was sent
        code = err.code or ("invalid_value" if err.status == 400 else None)
        body = {"error": {"message": err.message, "type": err.type, "param": err.param, "code": code}}
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def _validation(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc) or "body"
    kind = first.get("type", "")
    code = "invalid_value"
    if kind == "extra_forbidden":
        msg, code = f"{where}: this server does not know this field; leave it out", "unknown_parameter"
    elif kind == "missing":
        msg, code = f"{where}: required", "missing_required_parameter"
    elif kind in ("json_invalid", "model_attributes_type") and not loc:
        msg, code = "the body is not a JSON object", "invalid_json"
    else:
        msg = f"{where}: {first.get('msg', 'invalid value')}"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return ApiError(400, msg + more, param=where if loc else None, code=code)


def install(app: FastAPI, paths: dict[str, str]) -> None:
    """Register the handlers that turn every failure into ``error_response``."""

    async def on_api(request: Request, exc: Exception) -> JSONResponse:
        return error_response(request, to_api_error(exc, paths))

    async def on_invalid(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(request, to_api_error(_validation(exc), paths))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = None
        if exc.status_code == 413:  # a chunked body over the limit, found while reading it
            message, code = "the request body is larger than this server takes", "request_too_large"
        elif exc.status_code == 408:  # the next part of the body came later than body_timeout_s
            message, code = "the request body did not arrive in time; send it faster", "request_timeout"
        elif exc.status_code == 404:
            message = f"there is no route {request.url.path[:100]!r}; see GET /v1/models and docs/server.md"
        else:
            message = str(exc.detail)
        err = ApiError(exc.status_code, message, code=code, headers=dict(exc.headers or {}))
        return error_response(request, err)

    app.add_exception_handler(RequestValidationError, on_invalid)
    app.add_exception_handler(StarletteHTTPException, on_http)
    # by class, so Starlette answers them without re-raising; Exception is the 500 fallback,
    # which Starlette logs as the bug it is
    app.add_exception_handler(ApiError, on_api)
    app.add_exception_handler(UnillmError, on_api)
    app.add_exception_handler(Exception, on_api)
