"""Errors as JSON `{"error": {"type", "message"}}` with the right status, and the handlers that produce them.
On the Open Inference Protocol's routes (`/v2`) they are `{"error": "..."}` as the protocol says. Where the
OpenAI-compatible routes answer, the same errors come in OpenAI's shape, `{"error": {"message", "type",
"param", "code"}}` (a superset: `code` holds this service's error type), and a request that does not conform to
the schema is a 400 there, as OpenAI answers it.

Bad input is 400/413/415/422 and never a 500; 404 unknown model or version; 408 a body that did not arrive in time;
429 (with Retry-After) full queue; 503 not ready or draining; 504 deadline expired; 499 (never read) the client went
away; 500 `ModelOutputError` when a model computes what no response may hold (NaN or infinite scores). An error
message that echoes a client's text is written with its lone surrogates escaped (`printable`), so rendering an
error never fails. Each error carries the failure reason that the metrics count. Unexpected exceptions become a
JSON 500 in the request middleware (`service.http.middleware`), which keeps the connection usable.
"""

from __future__ import annotations

import json
import logging
import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)


class ServiceError(Exception):
    status = 500
    type = "internal_error"
    reason = "internal"

    def __init__(self, message: str, headers: dict[str, str] | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or {}
        self.param = param  # the request field it is about, when there is one


class BadInput(ServiceError):
    status, type, reason = 400, "bad_input", "bad_input"


class PayloadTooLarge(ServiceError):
    status, type, reason = 413, "payload_too_large", "bad_input"


class UnsupportedMediaType(ServiceError):
    status, type, reason = 415, "unsupported_media_type", "bad_input"


class NotFound(ServiceError):
    status, type, reason = 404, "not_found", "bad_input"


class QueueFull(ServiceError):
    status, type, reason = 429, "queue_full", "queue_full"

    def __init__(self, message: str, retry_after_s: float, retry_after_ms: int | None = None):
        headers = {"Retry-After": str(max(1, int(retry_after_s + 0.999)))}
        if retry_after_ms is not None:  # the OpenAI SDK's finer header, read before Retry-After
            headers["retry-after-ms"] = str(retry_after_ms)
        super().__init__(message, headers)


class Unavailable(ServiceError):
    status, type, reason = 503, "unavailable", "unavailable"


class DeadlineExceeded(ServiceError):
    status, type, reason = 504, "timeout", "timeout"


class Cancelled(ServiceError):
    status, type, reason = 499, "cancelled", "cancelled"  # the client went away; nobody reads this response


class ModelOutputError(ServiceError):
    """The model computed something that cannot be served (NaN or infinite scores): a fault of the model version,
    not of the request, answered as an explicit error instead of a response no JSON parser reads."""

    status, type, reason = 500, "model_output_error", "internal"


class ClientBodyError(StarletteHTTPException):
    """Raised inside the ASGI receive channel by the request middleware: a body over the size limit (413) or one
    that did not arrive in time (408). An HTTPException, because FastAPI's body parsing re-raises those as they are
    (anything else becomes a 400 "error parsing the body"); the connection is closed after the response, since the
    rest of the body may still be on its way."""

    def __init__(self, status: int, error_type: str, message: str):
        super().__init__(status, message, headers={"Connection": "close"})
        self.type = error_type


OPENAI_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models"})
# OpenAI's error types by status (the SDK maps the status to its exception class; the type is for people)
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
                 415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                 503: "service_unavailable_error", 504: "timeout_error"}


def openai_error_type(status: int) -> str:
    """OpenAI's error type for a status: the one mapping for every OpenAI error, streamed or not."""
    return _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def printable(text: str) -> str:
    """`text` as UTF-8 can carry it: a lone surrogate (which a client can send as a JSON escape) is written as its
    escape, so that echoing what a client sent can never fail to render."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def json_error_reason(error: Exception) -> str:
    """Why a body is not JSON that can be read, for error messages: the parser's own reason, or what made Python's
    `json.loads` raise something else (bytes that are not UTF-8, nesting past the recursion limit, an integer of
    more digits than Python converts)."""
    if isinstance(error, UnicodeDecodeError):
        return "it is not UTF-8"
    if isinstance(error, RecursionError):
        return "it is nested too deeply"
    if isinstance(error, json.JSONDecodeError):
        return f"{error.msg} (character {error.pos})"
    if isinstance(error, ValueError) and "digits" in str(error):  # Python's int(str) limit (no class of its own)
        return f"a number has more than {sys.get_int_max_str_digits()} digits"
    return type(error).__name__


def error_body(error_type: str, message: str) -> dict:
    return {"error": {"type": error_type, "message": message}}


def error_payload(path: str, status: int, error_type: str, message: str, param: str | None = None) -> tuple[int, dict]:
    """(status, body) of an error in the shape of the API at `path`."""
    message = printable(message)
    if path == "/v2" or path.startswith("/v2/"):  # the Open Inference Protocol's: {"error": "..."}, 400 if invalid
        return (400 if status == 422 else status), {"error": message}
    if path not in OPENAI_PATHS:
        return status, error_body(error_type, message)
    if status == 422:  # OpenAI answers a malformed request with 400
        status = 400
    return status, {"error": {"message": message, "type": openai_error_type(status),
                              "param": None if param is None else printable(param), "code": error_type}}


def error_response(request: Request, status: int, error_type: str, message: str, headers: dict | None = None,
                   param: str | None = None) -> JSONResponse:
    """The error in the shape of the API the request was for."""
    status, body = error_payload(request.url.path, status, error_type, message, param)
    return JSONResponse(body, status_code=status, headers=headers)


# pydantic names the member of a union in an error's location ("text.list[constrained-str].1"); a field name of this
# API is a plain identifier, so location parts that are type names or contain these characters are union members.
_UNION_MEMBER_CHARS = set("[]-'")
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _field_path(location) -> str:
    parts = [str(p) for p in location if p != "body" and not (
        isinstance(p, str) and (p in _TYPE_NAMES or _UNION_MEMBER_CHARS & set(p)))]
    return ".".join(parts) or "body"


def describe_validation(errors: list[dict]) -> str:
    """One line naming every invalid field. For a union (a text or a list of texts) pydantic reports each member;
    the "wrong type" of the member the value is not is dropped when the member it is has a real complaint."""
    items = [(_field_path(item.get("loc", ())), item) for item in errors]
    real = {path for path, item in items if not str(item.get("type", "")).endswith("_type")}
    parts = []
    for path, item in items:
        kind = str(item.get("type", ""))
        if kind.endswith("_type") and any(other == path or other.startswith(path + ".") for other in real):
            continue
        parts.append(f"{path}: {item.get('msg', 'invalid')}")
    return "; ".join(dict.fromkeys(parts)) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(request: Request, error: ServiceError) -> JSONResponse:
        return error_response(request, error.status, error.type, error.message, error.headers, error.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        request.state.failure_reason = "bad_input"
        errors = error.errors()
        first = errors[0].get("loc", ()) if errors else ()
        return error_response(request, 422, "invalid_request", describe_validation(errors), param=_field_path(first))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if isinstance(error.__cause__, ClientDisconnect):  # FastAPI's body parsing wraps it in a 400
            return await client_gone(request, error.__cause__)
        if isinstance(error.__cause__, (ValueError, RecursionError)):  # the same wrapping: JSON that cannot be read
            request.state.failure_reason = "bad_input"
            return error_response(request, 422, "invalid_request",
                                  f"body: not valid JSON ({json_error_reason(error.__cause__)})")
        kind = getattr(error, "type", None) or {404: "not_found", 405: "method_not_allowed"}.get(
            error.status_code, "http_error")
        return error_response(request, error.status_code, kind, str(error.detail), getattr(error, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, error: ClientDisconnect) -> JSONResponse:
        """The client went away while its body was being read: nobody reads this, and it is not a bad input."""
        return error_response(request, Cancelled.status, Cancelled.type, "client went away")
