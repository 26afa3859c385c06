"""The service's errors: `ServiceError` and its subclasses, each with its HTTP status, its type and the failure
reason that the metrics count; every layer (scheduling, engines, models, serving, the APIs) raises them, and none of
them needs HTTP code to do so. How they become responses, in each API's shape, is `service.http.errors`.

Bad input is 400/413/415 and never a 500; 404 unknown model or version; 501 a part of a protocol not offered; 429
(with Retry-After) full queue; 503 not ready, draining, or the request's version unloaded under it; 504 deadline
expired; 499 (never read) the client went away; 500 `ModelOutputError` when a model computes what no response may
hold (NaN or infinite scores). The message helpers are here too, for every layer: an error message that echoes a
client's text is written with its lone surrogates escaped (`printable`), so rendering an error never fails;
`json_error_reason` says why a body is not JSON, `describe_validation` which fields are invalid.
"""

from __future__ import annotations

import json
import sys


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


class Unauthorized(ServiceError):
    """A missing or wrong API key on a gRPC call (HTTP requests are answered by `service.http.auth` itself)."""

    status, type, reason = 401, "unauthorized", "unauthorized"


class PayloadTooLarge(ServiceError):
    status, type, reason = 413, "payload_too_large", "bad_input"


class UnsupportedMediaType(ServiceError):
    status, type, reason = 415, "unsupported_media_type", "bad_input"


class NotFound(ServiceError):
    status, type, reason = 404, "not_found", "bad_input"


class NotImplementedHere(ServiceError):
    """A part of a protocol this service does not offer (OIP shared memory, trace and log settings): the client's
    request is well formed, the service says it will never do it (HTTP 501, gRPC UNIMPLEMENTED)."""

    status, type, reason = 501, "not_implemented", "bad_input"


class QueueFull(ServiceError):
    status, type, reason = 429, "queue_full", "queue_full"

    def __init__(self, message: str, retry_after_s: int, retry_after_ms: int | None = None):
        headers = {"Retry-After": str(retry_after_s)}  # whole seconds: `scheduling.queueing.retry_after_seconds`
        if retry_after_ms is not None:  # the OpenAI SDK's finer header, read before Retry-After
            headers["retry-after-ms"] = str(retry_after_ms)
        super().__init__(message, headers)


class Unavailable(ServiceError):
    status, type, reason = 503, "unavailable", "unavailable"


class VersionUnloaded(Unavailable):
    """A request accepted by a model version that was unloaded (model control) before it finished: the server
    serves on, and a retry that names no version reaches the model's active one."""

    type, reason = "model_unloaded", "unloaded"


class DeadlineExceeded(ServiceError):
    status, type, reason = 504, "timeout", "timeout"


class Cancelled(ServiceError):
    status, type, reason = 499, "cancelled", "cancelled"  # the client went away; nobody reads this response


class ModelOutputError(ServiceError):
    """The model computed something that cannot be served (NaN or infinite scores): a fault of the model version,
    not of the request, answered as an explicit error instead of a response no JSON parser reads."""

    status, type, reason = 500, "model_output_error", "internal"


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


# pydantic names the member of a union in an error's location ("text.list[constrained-str].1"); a field name of this
# API is a plain identifier, so location parts that are type names or contain these characters are union members.
_UNION_MEMBER_CHARS = set("[]-'")
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def field_path(location) -> str:
    """The request field a pydantic error location names ("body" for the body as a whole)."""
    parts = [str(p) for p in location if p != "body" and not (
        isinstance(p, str) and (p in _TYPE_NAMES or _UNION_MEMBER_CHARS & set(p)))]
    return ".".join(parts) or "body"


def describe_validation(errors: list[dict]) -> str:
    """One line naming every invalid field. For a union (a text or a list of texts) pydantic reports each member;
    the "wrong type" of the member the value is not is dropped when the member it is has a real complaint."""
    items = [(field_path(item.get("loc", ())), item) for item in errors]
    real = {path for path, item in items if not str(item.get("type", "")).endswith("_type")}
    parts = []
    for path, item in items:
        kind = str(item.get("type", ""))
        if kind.endswith("_type") and any(other == path or other.startswith(path + ".") for other in real):
            continue
        parts.append(f"{path}: {item.get('msg', 'invalid')}")
    return "; ".join(dict.fromkeys(parts)) or "invalid request"
