"""Errors as HTTP responses: the exception handlers, each error in the shape of the API the request was for.

The hierarchy (`ServiceError` and its subclasses, with status, type and failure reason) is `service.errors`, which
every layer raises; here it becomes a response. The shape is the API's error renderer (`service.http.apis`): the
native `{"error": {"type", "message"}}`, OpenAI's `{"error": {"message", "type", "param", "code"}}`
(`service.api.openai.errors`), the Open Inference Protocol's `{"error": "..."}` (`service.api.oip.errors`). A
request that does not conform to its schema is a 422, which OpenAI and the Open Inference Protocol answer as 400.
Messages are written `printable`, so rendering an error never fails. Unexpected exceptions become a JSON 500 in
the request middleware (`service.http.middleware`), which keeps the connection usable.
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from service.errors import (
    Cancelled,
    ServiceError,
    UnsupportedMediaType,
    describe_validation,
    field_path,
    json_error_reason,
    printable,
)
from service.http.apis import VALIDATION_STATUS, Api, ApiTable
from service.http.routing import NOT_JSON_STATUS

# The error type of a request that does not conform to its schema (status VALIDATION_STATUS) or is not JSON.
INVALID_TYPE = "invalid_request"
# Error types of routing's own HTTP errors, by status (anything else: "http_error").
HTTP_ERROR_TYPES = {404: "not_found", 405: "method_not_allowed"}
JSON_MEDIA_TYPE = "application/json"


def media_type(request: Request) -> str:
    """The request's Content-Type without its parameters, lower case ("" when it has none)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def non_json_media_type(request: Request) -> str | None:
    """What a request that sent a body FastAPI does not read as JSON declared it as: its media type, or "" for a body
    sent without a Content-Type (FastAPI reads JSON only under application/json or application/*+json); None for
    a JSON body, or no body at all (the schema's own error says what is missing)."""
    media = media_type(request)
    maintype, _, subtype = media.partition("/")
    if maintype == "application" and (subtype == "json" or subtype.endswith("+json")):
        return None
    if not media and request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in request.headers:
        return None
    return media


class ClientBodyError(StarletteHTTPException):
    """Raised inside the ASGI receive channel by the request middleware: a body over the size limit (413) or one
    that did not arrive in time (408). An HTTPException, because FastAPI's body parsing re-raises those as they are
    (anything else becomes a 400 "error parsing the body"); the connection is closed after the response, since the
    rest of the body may still be on its way."""

    def __init__(self, status: int, error_type: str, message: str):
        super().__init__(status, message, headers={"Connection": "close"})
        self.type = error_type


def error_payload(api: Api, status: int, error_type: str, message: str, param: str | None = None) -> tuple[int, dict]:
    """(status, body) of an error in `api`'s shape."""
    return api.render(status, error_type, printable(message), None if param is None else printable(param))


async def send_error(api: Api, send, status: int, error_type: str, message: str, headers: dict | None = None) -> None:
    """An error response in `api`'s shape, sent on an ASGI `send` (by middleware, outside FastAPI's handlers)."""
    status, payload = error_payload(api, status, error_type, message)
    body = json.dumps(payload).encode()
    extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())] + extra})
    await send({"type": "http.response.body", "body": body})


def install_error_handlers(app: FastAPI, apis: ApiTable) -> None:
    """The handlers of `ServiceError`, schema validation, routing's HTTP errors and a client gone mid-body; each
    answers in the shape of the request's API (`apis`)."""

    def respond(request: Request, status: int, error_type: str, message: str, headers: dict | None = None,
                param: str | None = None) -> JSONResponse:
        status, body = error_payload(apis.api(request.scope), status, error_type, message, param)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, error: ServiceError) -> JSONResponse:
        request.state.failure_reason = error.reason  # the error's own (a 503 may be `unavailable` or `unloaded`)
        return respond(request, error.status, error.type, error.message, error.headers, error.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        request.state.failure_reason = "bad_input"
        errors = error.errors()
        media = non_json_media_type(request)
        if media is not None and any(tuple(e.get("loc", ())) == ("body",) for e in errors):
            # a JSON route sent a form, text or no Content-Type: its body was never read as JSON; say what to send
            sent = f"Content-Type {media!r} is" if media else "a body without a Content-Type is"
            return respond(request, NOT_JSON_STATUS, UnsupportedMediaType.type,
                           f"{sent} not supported here; send {JSON_MEDIA_TYPE}")
        first = errors[0].get("loc", ()) if errors else ()
        return respond(request, VALIDATION_STATUS, INVALID_TYPE, describe_validation(errors), param=field_path(first))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if isinstance(error.__cause__, ClientDisconnect):  # FastAPI's body parsing wraps it in a 400
            return await client_gone(request, error.__cause__)
        if isinstance(error.__cause__, (ValueError, RecursionError)):  # the same wrapping: JSON that cannot be read
            request.state.failure_reason = "bad_input"
            return respond(request, VALIDATION_STATUS, INVALID_TYPE,
                           f"body: not valid JSON ({json_error_reason(error.__cause__)})")
        kind = getattr(error, "type", None) or HTTP_ERROR_TYPES.get(error.status_code, "http_error")
        return respond(request, error.status_code, kind, str(error.detail), getattr(error, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, error: ClientDisconnect) -> JSONResponse:
        """The client went away while its body was being read: nobody reads this, and it is not a bad input."""
        return respond(request, Cancelled.status, Cancelled.type, "client went away")
