"""Errors as JSON `{"error": {"type", "message"}}` with the right status, and the handlers that produce them.

Bad input is 400/413/415/422 and never a 500; 404 unknown model or version; 429 (with Retry-After) full queue;
503 not ready or draining; 504 deadline expired. Each error carries the failure reason that the metrics count.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class ServiceError(Exception):
    status = 500
    type = "internal_error"
    reason = "internal"

    def __init__(self, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


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

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message, {"Retry-After": str(max(1, int(retry_after_s + 0.999)))})


class Unavailable(ServiceError):
    status, type, reason = 503, "unavailable", "unavailable"


class DeadlineExceeded(ServiceError):
    status, type, reason = 504, "timeout", "timeout"


class Cancelled(ServiceError):
    status, type, reason = 499, "cancelled", "cancelled"  # the client went away; nobody reads this response


def error_body(error_type: str, message: str) -> dict:
    return {"error": {"type": error_type, "message": message}}


def _describe_validation(error: RequestValidationError) -> str:
    parts = []
    for item in error.errors():
        location = ".".join(str(p) for p in item.get("loc", ()) if p not in ("body",)) or "body"
        parts.append(f"{location}: {item.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def service_error(request: Request, error: ServiceError) -> JSONResponse:
        return JSONResponse(error_body(error.type, error.message), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        request.state.failure_reason = "bad_input"
        return JSONResponse(error_body("invalid_request", _describe_validation(error)), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        return JSONResponse(error_body(kind, str(error.detail)), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        request.state.failure_reason = "internal"
        return JSONResponse(error_body("internal_error", "internal error; see the server log"), status_code=500)
