"""The SERVER span of one HTTP request (`service.observability.tracing.start_request` starts it while tracing is
on), after the stable HTTP semantic conventions of OpenTelemetry; a gRPC request's (`start_rpc`) after the RPC ones.

Started by the request middleware (`service.http.middleware`) before anything else, named `{method} {route
template}` (or the method alone when no route matched), a child of the caller's trace when the request carries a
W3C `traceparent` header; its trace id goes into the request's access-log line (`trace_id`). Status ERROR for a
5xx, a 499 (the client went away) or a failure after the status was sent; other 4xx leave it unset, as the
conventions say. The probes and the scrape (`/health/*`, `/metrics`) are not traced, as they are not access-logged.
Invariant: the span's start and end are taken on the clock of the jobs' phase spans, so they nest exactly.

Design notes (the attributes): docs/architecture.md, service/observability/request_span.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

UNTRACED_PATHS = frozenset({"/metrics", "/health/live", "/health/ready"})
CLIENT_CLOSED_REQUEST = 499  # the status of a request whose client went away: an error of the server's side
SERVER_ERRORS_FROM = 500  # statuses from here on are the server's errors

_propagator = TraceContextTextMapPropagator()


class RequestSpan:
    """The SERVER span of one request, current (in the OpenTelemetry context) until `end`."""

    __slots__ = ("_epoch_ns", "_token", "span")

    def __init__(self, span, token, epoch_ns: Callable[[float], int]):
        self.span, self._token, self._epoch_ns = span, token, epoch_ns

    @property
    def trace_id(self) -> str | None:
        """32 hex digits, or None when the span has no valid trace id."""
        context = self.span.get_span_context()
        return trace.format_trace_id(context.trace_id) if context.trace_id else None

    def end(self, scope, state: Mapping, status: int, error: BaseException | None = None) -> str | None:
        """Set the outcome's attributes and status, end the span now; returns its trace id (for the access log)."""
        otel_context.detach(self._token)
        span = self.span
        if span.is_recording():
            route = getattr(scope.get("route"), "path", None) if scope else None
            if route:
                span.update_name(f"{scope.get('method', '')} {route}")
                span.set_attribute("http.route", route)
            span.set_attribute("http.response.status_code", status)
            for key in ("model", "version", "mode"):
                if state.get(key) not in (None, ""):
                    span.set_attribute(f"tserve.{key}", state[key])
            reason = state.get("failure_reason")
            if error is not None:
                span.record_exception(error)
            status_failed = status >= SERVER_ERRORS_FROM or status == CLIENT_CLOSED_REQUEST
            if status_failed or reason or error is not None:  # a failed status names itself (the conventions)
                cause = None if status_failed else reason
                span.set_attribute("error.type", cause or (type(error).__name__ if error else str(status)))
                span.set_status(Status(StatusCode.ERROR, reason or (str(error) if error else None)))
        span.end(end_time=self._epoch_ns(time.monotonic()))
        return self.trace_id


def start(tracer: Tracer, epoch_ns: Callable[[float], int], scope,
          headers: Mapping[bytes, bytes]) -> RequestSpan | None:
    """Start the SERVER span of an HTTP request (a child of its `traceparent`, if any) and make it current; None
    for the paths that are not traced."""
    path = scope.get("path", "")
    if path in UNTRACED_PATHS:
        return None
    carrier = {}
    for name in ("traceparent", "tracestate"):
        value = headers.get(name.encode())
        if value:
            carrier[name] = value.decode("latin-1")
    parent = _propagator.extract(carrier)  # an empty context without a valid traceparent: a new trace
    method = scope.get("method", "")
    attributes = {"http.request.method": method, "url.path": path, "url.scheme": scope.get("scheme", "http"),
                  "network.protocol.version": scope.get("http_version", "1.1")}
    server, client = scope.get("server"), scope.get("client")
    if server:
        attributes["server.address"], attributes["server.port"] = server[0], server[1] or 0
    if client:
        attributes["client.address"] = client[0]
    agent = headers.get(b"user-agent")
    if agent:
        attributes["user_agent.original"] = agent.decode("latin-1")
    request_id = scope.get("state", {}).get("request_id")
    if request_id:
        attributes["tserve.request_id"] = request_id
    span = tracer.start_span(method, context=parent, kind=SpanKind.SERVER, attributes=attributes,
                             start_time=epoch_ns(time.monotonic()))
    return RequestSpan(span, otel_context.attach(trace.set_span_in_context(span, parent)), epoch_ns)


def start_rpc(tracer: Tracer, epoch_ns: Callable[[float], int], method: str, metadata: Mapping[str, str],
              peer: str | None, request_id: str) -> RequestSpan:
    """Start the SERVER span of a gRPC request to `method` (`/package.Service/Method`) and make it current."""
    carrier = {name: metadata[name] for name in ("traceparent", "tracestate") if metadata.get(name)}
    parent = _propagator.extract(carrier)
    service, _, name = method.strip("/").partition("/")
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name, "tserve.request_id": request_id}
    if peer:
        attributes["client.address"] = peer
    span = tracer.start_span(method.strip("/"), context=parent, kind=SpanKind.SERVER, attributes=attributes,
                             start_time=epoch_ns(time.monotonic()))
    return RequestSpan(span, otel_context.attach(trace.set_span_in_context(span, parent)), epoch_ns)
