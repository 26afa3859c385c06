"""One gRPC request as the serving layer sees a request (`GrpcCall`, a `service.serving.context.Caller`), and what
each one gets around its work, as the HTTP middleware (`service.http.middleware`) gives a REST request: API keys
(`authorization: Bearer <key>` metadata, the same `ApiKeys` as HTTP's; `grpc.health.v1` stays open), errors mapped
to status codes (`STATUS_CODES`), the deadline, the request id, the access log, the request metrics
(`api="oip-grpc"`) and a SERVER trace span while tracing is on.

Invariant: a call is observed as a REST request is, its outcome counted by the HTTP status it maps to (200 or its
error's), so one dashboard and Triton's statistics read every API alike; anything unexpected is INTERNAL, logged
with its traceback; a status message always fits the client's metadata limit (`MAX_MESSAGE_BYTES`).

Design notes (each of these in full): docs/architecture.md, service/api/oip/grpc/calls.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import TypeVar

import grpc

from service.errors import BadInput, Cancelled, QueueFull, ServiceError, Unauthorized, printable
from service.http.auth import ApiKeys
from service.observability import tracing
from service.observability import logs

log = logging.getLogger(__name__)

API = "oip-grpc"  # the metrics' `api` label of this transport
SERVICE = "inference.GRPCInferenceService"
OK_STATUS, INTERNAL_STATUS = 200, 500
CANCELLED_STATUS = Cancelled.status  # 499: the client went away (cancelled the call, or its deadline passed)
STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
                408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.INVALID_ARGUMENT,
                415: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                499: grpc.StatusCode.CANCELLED, 500: grpc.StatusCode.INTERNAL, 501: grpc.StatusCode.UNIMPLEMENTED,
                503: grpc.StatusCode.UNAVAILABLE,
                504: grpc.StatusCode.DEADLINE_EXCEEDED}
INTERNAL_MESSAGE = "internal error; see the server log"
# The most of a status message sent, in UTF-8 bytes. It travels in the trailers (`grpc-message`, percent-encoded:
# up to 3 bytes a byte), which a client refuses past its metadata limit (grpcio: 8 KiB, then RESOURCE_EXHAUSTED);
# every message the service writes is far shorter, only an echo of a client's huge input (a name, a key) is cut.
MAX_MESSAGE_BYTES = 1024
REQUEST_ID_KEY, AUTHORIZATION_KEY = "x-request-id", "authorization"
MS_PER_S = 1000  # a gRPC deadline (seconds remaining) as the serving layer's ms
T = TypeVar("T")


class GrpcCall:
    """One request of a gRPC call, as the serving layer reads a request: the app, the request's `state` (leases
    and labels), and whether the client is still there."""

    def __init__(self, app, context: grpc.aio.ServicerContext, request_id: str):
        self.app, self.context, self.request_id = app, context, request_id
        self.state = SimpleNamespace()

    async def is_disconnected(self) -> bool:
        return self.context.cancelled()

    def remaining_ms(self) -> int | None:
        """What is left of the call's gRPC deadline, in ms (None: the client set none)."""
        remaining = self.context.time_remaining()
        return None if remaining is None else max(1, int(remaining * MS_PER_S))


def bounded(message: str) -> str:
    """`message` as a status (or a stream's `error_message`) carries it: valid UTF-8, at most MAX_MESSAGE_BYTES,
    cut with a note saying how long it was."""
    text = printable(message)
    data = text.encode()
    if len(data) <= MAX_MESSAGE_BYTES:
        return text
    note = f"... (cut: {len(data)} bytes)"
    return data[: MAX_MESSAGE_BYTES - len(note)].decode("utf-8", "ignore") + note


def status_code(error: ServiceError) -> grpc.StatusCode:
    return STATUS_CODES.get(error.status, grpc.StatusCode.UNKNOWN)


def trailing_metadata(error: ServiceError) -> tuple[tuple[str, str], ...]:
    """The error's retry hint (a 429's Retry-After) as trailing metadata, lower-cased as gRPC wants its keys."""
    if not isinstance(error, QueueFull):
        return ()
    return tuple((key.lower(), value) for key, value in error.headers.items())


class Calls:
    """What every RPC runs its work through (`unary`; a stream's requests: `begin` / `end`)."""

    def __init__(self, app, keys: ApiKeys):
        self.app, self.keys = app, keys

    def _metadata(self, context: grpc.aio.ServicerContext) -> list[tuple[str, str | bytes]]:
        return list(context.invocation_metadata() or ())

    def authorize(self, context: grpc.aio.ServicerContext) -> None:
        """Unauthorized unless the call carries a configured key (a pass when none is configured)."""
        if not self.keys:
            return
        values = [v if isinstance(v, bytes) else v.encode("latin-1")
                  for k, v in self._metadata(context) if k.lower() == AUTHORIZATION_KEY]
        if problem := self.keys.check(values):  # worded for HTTP headers: said of gRPC metadata here
            raise Unauthorized(problem.replace("the header 'Authorization", "the metadata 'authorization")
                               .replace("Authorization header", "authorization metadata entry"))

    def begin(self, context: grpc.aio.ServicerContext, method: str) -> tuple[GrpcCall, object, float]:
        """A request's GrpcCall, its trace span (None: tracing off) and its start time."""
        metadata = {k.lower(): v for k, v in self._metadata(context) if isinstance(v, str)}
        call = GrpcCall(self.app, context, logs.request_id(metadata.get(REQUEST_ID_KEY, "")))
        span = None if tracing.tracer is None else tracing.start_rpc(f"/{SERVICE}/{method}", metadata,
                                                                      context.peer(), call.request_id)
        return call, span, time.perf_counter()

    def end(self, call: GrpcCall, span, started: float, method: str, counted: bool, status: int,
            error: BaseException | None = None) -> None:
        """Release the request's leases, end its span, count it (inference only) and log its access line."""
        state = call.state
        for loaded in getattr(state, "leases", ()):
            loaded.release()
        state.leases = []
        labels = vars(state)
        trace_id = None if span is None else span.end(None, labels, status, error)
        seconds = time.perf_counter() - started
        model, version, mode = labels.get("model", ""), str(labels.get("version", "")), labels.get("mode", "")
        if counted:
            self.app.state.metrics.count_request(endpoint=method, api=API, model=model, version=version, mode=mode,
                                                 status=status, seconds=seconds,
                                                 failure_reason=labels.get("failure_reason"))
        logs.log_access(request_id=call.request_id, method="GRPC", path=f"/{SERVICE}/{method}", model=model or None,
                        version=int(version) if version else None, mode=mode or None, status=status,
                        latency_ms=logs.latency_ms(seconds), **({"trace_id": trace_id} if trace_id else {}))

    async def unary(self, context: grpc.aio.ServicerContext, method: str, work: Callable[[GrpcCall], Awaitable[T]],
                    counted: bool = False) -> T:
        """Run `work(call)` as one request: authorized, observed, its errors the call's status."""
        call, span, started = self.begin(context, method)
        status, failure = INTERNAL_STATUS, None
        request_id = ((REQUEST_ID_KEY, call.request_id),)  # trailing: it rides on the status, no frame of its own
        try:
            self.authorize(context)
            result = await work(call)
            context.set_trailing_metadata(request_id)
            status = OK_STATUS
            return result
        except ServiceError as error:
            status, failure = error.status, error
            call.state.failure_reason = error.reason  # the error's own, as REST's (a 503: unavailable or unloaded)
            await context.abort(status_code(error), bounded(error.message), request_id + trailing_metadata(error))
        except asyncio.CancelledError as error:
            status, failure = CANCELLED_STATUS, error
            raise
        except Exception as error:
            if isinstance(error, grpc.aio.AbortError):
                raise
            failure = error
            log.exception("unhandled error in %s", method)
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
        finally:
            self.end(call, span, started, method, counted, status, failure)

    async def refuse(self, context: grpc.aio.ServicerContext, method: str, message: str) -> None:
        """Refuse a request as bad input (INVALID_ARGUMENT, logged as a 400), its API key checked first."""
        async def work(call):
            raise BadInput(message)
        await self.unary(context, method, work)
