"""One gRPC request as the serving layer sees a request (`GrpcCall`, a `service.serving.context.Caller`), and what
each one gets around its work, as the HTTP middleware (`service.http.middleware`) gives a REST request.

- **API keys**: with keys configured, every call of `inference.GRPCInferenceService` needs `authorization: Bearer
  <key>` metadata, checked by the same `ApiKeys` as HTTP's (`service.http.auth`); `grpc.health.v1` stays open, as
  /health does (Kubernetes' gRPC probes send no metadata). A missing or wrong key is UNAUTHENTICATED.
- **Errors**: a `ServiceError` becomes the status code of its HTTP status (`STATUS_CODES`: 400 INVALID_ARGUMENT,
  404 NOT_FOUND, 429 RESOURCE_EXHAUSTED with `retry-after` (seconds) and `retry-after-ms` trailing metadata, 503
  UNAVAILABLE, 504 DEADLINE_EXCEEDED, ...) with its message; anything unexpected is INTERNAL ("see the server
  log"), logged with its traceback. A client that cancels (or whose deadline passes in flight) ends the call's task:
  its jobs are cancelled on the way out (`service.serving.awaiting`), counted as 499.
- **Deadline**: the call's gRPC deadline (what `client_timeout` sets) is the request's deadline unless the request's
  `timeout` parameter says otherwise (`service.api.oip.inference.deadline`).
- **Observed**: the request id (`x-request-id` metadata when it is tame, else a new one, as HTTP's; sent back as
  trailing metadata of a unary call), the leases of the model versions it resolved released at its end, one
  access-log line (method "GRPC", path `/inference.GRPCInferenceService/<rpc>`), and for inference (ModelInfer,
  each request of a ModelStreamInfer) the request metrics with `api="oip-grpc"`, `endpoint` the RPC's name and
  `status` the HTTP status its outcome maps to (200 or its error's), so one dashboard and Triton's statistics read
  every API alike.
  A SERVER trace span per request while tracing is on (`service.observability.request_span.start_rpc`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import TypeVar

import grpc

from service.errors import Cancelled, QueueFull, ServiceError, Unauthorized
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
            await context.abort(status_code(error), error.message, request_id + trailing_metadata(error))
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
