"""OpenTelemetry tracing: one SERVER span per HTTP request, with child spans for the scheduler's phases of its
work. Off unless the standard `OTEL_*` environment variables ask for it; when off, nothing of the SDK exists and
the request path pays one module-attribute check (`tracer is None`).

Switching it on (`configure_from_environment()`, called by `create_app`), following the OpenTelemetry SDK
environment-variable specification, except that an unset exporter means "off" rather than "otlp":
- `OTEL_SDK_DISABLED=true`: off, whatever else is set;
- `OTEL_TRACES_EXPORTER`: a comma-separated list of `otlp` (OTLP over HTTP/protobuf), `console` (spans as JSON
  on stdout) and `none`; on when it names anything but `none`;
- unset, tracing is on (exporter `otlp`) when `OTEL_EXPORTER_OTLP_ENDPOINT` (the exporter posts to
  `<endpoint>/v1/traces`) or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (posted to as it is) is set, else off.
The SDK reads the rest itself: `OTEL_SERVICE_NAME` (default here: "tserve") and `OTEL_RESOURCE_ATTRIBUTES`, the
sampler (`OTEL_TRACES_SAMPLER`, default parentbased_always_on: a caller's sampling decision is followed), the batch
processor (`OTEL_BSP_SCHEDULE_DELAY`, `OTEL_BSP_MAX_QUEUE_SIZE`, ...) and the exporter's headers, timeout,
compression and certificates (`OTEL_EXPORTER_OTLP_*`). Only the HTTP/protobuf protocol is installed (the OTLP
receivers of the Collector, Jaeger and Tempo listen for it on port 4318). Tests and embedders call `setup(exporter)`.

The spans:
- `POST /v1/generate` (SERVER; `{method} {route template}`, or the method alone when no route matched): started
  by the request middleware (`service.http.middleware`) before anything else, a child of the caller's trace when the
  request carries a W3C `traceparent` (and `tracestate`) header; the stable HTTP semantic-convention attributes
  (`http.request.method`, `url.path`, `url.scheme`, `http.route`, `http.response.status_code`, `server.*`,
  `client.address`, `network.protocol.version`, `user_agent.original`) and this service's `tserve.request_id`,
  `tserve.model`, `tserve.version`, `tserve.mode`. Its trace id goes into the request's access-log line
  (`trace_id`). Status ERROR for a 5xx, a 499 (the client went away) or a failure after the status was sent (a
  stream); other 4xx are the client's errors and leave the status unset, as the conventions say.
  The probes and the scrape (`/health/*`, `/metrics`) are not traced, as they are not access-logged.
- per text job (one per prompt and choice, or per text to translate; `tserve.job` = its index in the request):
  `queue_wait` (arrival to admission into the batch), `prefill` (admission to its first token) and `decode` (first
  token to its end), with `tserve.model`, `tserve.version`, `tserve.mode`, `tserve.rows` (the rows it held in the
  batch: its beam width), `tserve.prompt_tokens` and `tserve.generated_tokens`;
- per image job: `queue_wait` and `inference` (`tserve.images`: the request's, `tserve.batch_size`: the batch's).
A job that failed or was given up ends its last phase (at the moment it was seen) with status ERROR.

The schedulers' worker threads create no spans: they only stamp the phase boundaries on the job (time.monotonic():
`arrived`, `admitted_at`, `first_token_at`, `finished_at`; images `started_at`, `finished_at`), and the serving
layer creates the child spans afterwards, on the event loop, with those times converted to epoch nanoseconds by
one offset taken at setup. The server span's own start and end are taken on the same clock, so a request's spans
nest and order exactly.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "tserve"
SERVICE_VERSION = "0.1.0"
INSTRUMENTATION = "service.observability.tracing"
EXPORTERS = ("otlp", "console")
UNTRACED_PATHS = frozenset({"/metrics", "/health/live", "/health/ready"})

# The module's state: `tracer` is None while tracing is off (the check the request path makes).
tracer: trace.Tracer | None = None
_provider = None  # the SDK's TracerProvider, while on
_offset_ns = 0  # epoch ns - monotonic ns, taken once at setup
_propagator = TraceContextTextMapPropagator()


# --- switching on and off ---------------------------------------------------------------------------------------

def exporters_from_environment(env: Mapping[str, str] | None = None) -> list[str]:
    """The span exporters the `OTEL_*` variables ask for (see the module docstring); [] = tracing off."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [name.strip().lower() for name in env.get("OTEL_TRACES_EXPORTER", "").split(",") if name.strip()]
    if names:
        unknown = [name for name in names if name not in EXPORTERS and name != "none"]
        if unknown:
            log.warning("OTEL_TRACES_EXPORTER: ignoring %s (this service exports with: %s, none)",
                        ", ".join(unknown), ", ".join(EXPORTERS))
        return [name for name in dict.fromkeys(names) if name in EXPORTERS]
    endpoints = (env.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""), env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", ""))
    return ["otlp"] if any(e.strip() for e in endpoints) else []


def configure_from_environment() -> bool:
    """Switch tracing on if the environment asks for it and it is not on already; whether it is on. Never
    switches it off (a test's `setup(exporter)` stays)."""
    if tracer is not None:
        return True
    names = exporters_from_environment()
    if not names:
        return False
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    processors = []
    for name in names:
        if name == "otlp":
            protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or \
                os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
            if protocol != "http/protobuf":
                log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s is not supported: exporting with http/protobuf", protocol)
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )

            exporter = OTLPSpanExporter()
            log.info("tracing on: OTLP/HTTP spans to %s", getattr(exporter, "_endpoint", "the OTLP endpoint"))
        else:
            exporter = ConsoleSpanExporter()
            log.info("tracing on: spans to stdout")
        processors.append(BatchSpanProcessor(exporter))  # OTEL_BSP_* from the environment
    _install(processors)
    return True


def setup(exporter=None, *, batch: bool = False) -> bool:
    """Switch tracing on: with `exporter` (an SDK `SpanExporter`, e.g. `InMemorySpanExporter` in tests) spans go
    to it, each as it ends (`SimpleSpanProcessor`) unless `batch`; without, as the environment says
    (`configure_from_environment`). Replaces a setup made before. Whether tracing is on."""
    if exporter is None:
        return configure_from_environment()
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    shutdown()
    _install([BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)])
    return True


def _install(processors: Sequence) -> None:
    global tracer, _provider, _offset_ns
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    resource = Resource.create()  # OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME
    defaults = {}
    if str(resource.attributes.get("service.name", "unknown_service")).startswith("unknown_service"):
        defaults["service.name"] = DEFAULT_SERVICE_NAME  # the SDK's default: neither variable named the service
    if "service.version" not in resource.attributes:
        defaults["service.version"] = SERVICE_VERSION
    resource = resource.merge(Resource(defaults))
    provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER
    for processor in processors:
        provider.add_span_processor(processor)
    _offset_ns = time.time_ns() - time.monotonic_ns()
    _provider, tracer = provider, provider.get_tracer(INSTRUMENTATION, SERVICE_VERSION)


def flush(timeout_s: float = 5.0) -> None:
    """Export the spans still buffered (at shutdown)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * 1000))


def shutdown() -> None:
    """Export what is buffered and switch tracing off."""
    global tracer, _provider
    provider, tracer, _provider = _provider, None, None
    if provider is not None:
        provider.shutdown()


def epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as epoch nanoseconds (the spans' clock)."""
    return _offset_ns + int(monotonic_s * 1e9)


# --- the request's span (the request middleware) ----------------------------------------------------------------

class RequestSpan:
    """The SERVER span of one request, current (in the OpenTelemetry context) until `end`."""

    __slots__ = ("_token", "span")

    def __init__(self, span, token):
        self.span, self._token = span, token

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
            route = getattr(scope.get("route"), "path", None)
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
            if status >= 500 or status == 499 or reason or error is not None:
                span.set_attribute("error.type", reason or (type(error).__name__ if error else str(status)))
                span.set_status(Status(StatusCode.ERROR, reason or (str(error) if error else None)))
        span.end(end_time=epoch_ns(time.monotonic()))
        return self.trace_id


def start_request(scope, headers: Mapping[bytes, bytes]) -> RequestSpan | None:
    """Start the SERVER span of an HTTP request (a child of its `traceparent`, if any) and make it current; None
    for the paths that are not traced. Only call while tracing is on (`tracer is not None`)."""
    path = scope.get("path", "")
    if path in UNTRACED_PATHS or tracer is None:
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
    return RequestSpan(span, otel_context.attach(trace.set_span_in_context(span, parent)))


# --- the scheduler's phases (the serving layer) -----------------------------------------------------------------

class _Off:
    """What `text_spans` / `image_spans` return while tracing is off: does nothing."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def record(self, error: BaseException | None = None) -> None:
        pass


_OFF = _Off()


class JobSpans:
    """The phase spans of a request's scheduler jobs, created once the request's wait for them is over: on leaving
    `with` (given the error that ended the wait, if any), or by `record()`. The parent is the span current when
    this was made (the request's), whenever `record` runs."""

    def __init__(self, loaded, jobs: Sequence, image: bool):
        self.loaded, self.jobs, self.image = loaded, jobs, image
        self.parent = otel_context.get_current()
        self.recorded = False

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        self.record(error)
        return False

    def record(self, error: BaseException | None = None) -> None:
        """Create the spans (once); `error`: what ended the request's wait, for jobs left unfinished."""
        if self.recorded or tracer is None:
            return
        self.recorded = True
        now = time.monotonic()
        base = {"tserve.model": self.loaded.name, "tserve.version": self.loaded.version}
        for index, job in enumerate(self.jobs):
            attributes = dict(base)
            failure = _failure(job.future, error)
            if self.image:
                attributes.update({"tserve.mode": "classify", "tserve.images": job.size})
                phases = [("queue_wait", job.arrived, job.started_at, {}),
                          ("inference", job.started_at, job.finished_at, {"tserve.batch_size": job.batch_size})]
            else:
                generated = _generated_tokens(job, failure)
                attributes.update({"tserve.job": index, "tserve.mode": job.mode,
                                   "tserve.rows": job.search.max_rows,
                                   "tserve.prompt_tokens": len(job.input_ids)})
                if generated is not None:
                    attributes["tserve.generated_tokens"] = generated
                phases = [("queue_wait", job.arrived, job.admitted_at, {}),
                          ("prefill", job.admitted_at, job.first_token_at, {}),
                          ("decode", job.first_token_at, job.finished_at, {})]
            _phase_spans(phases, attributes, failure, now, self.parent)


def text_spans(loaded, jobs: Sequence) -> JobSpans | _Off:
    """`with tracing.text_spans(loaded, jobs): <await the jobs>`: their queue_wait / prefill / decode spans."""
    return _OFF if tracer is None else JobSpans(loaded, jobs, image=False)


def image_spans(loaded, job) -> JobSpans | _Off:
    """`with tracing.image_spans(loaded, job): <await the job>`: its queue_wait / inference spans."""
    return _OFF if tracer is None else JobSpans(loaded, [job], image=True)


def _failure(future, seen: BaseException | None) -> BaseException | str | None:
    """Why a job did not succeed: its own error, or (given up, unfinished) what ended the wait; None if it did."""
    if future.done() and not future.cancelled():
        return future.exception()
    return seen if seen is not None else "cancelled"


def _generated_tokens(job, failure) -> int | None:
    if failure is None:
        return max((len(h.tokens) for h in job.future.result()), default=0)
    generated = getattr(job.search, "generated", None)  # single-row searches: what it got to
    return None if generated is None else len(generated)


def _phase_spans(phases, attributes: dict, failure, now: float, parent) -> None:
    """One span per phase that started, each from its start to the next boundary; the last one ends at its own
    end, or `now` when the job never got there, and carries the failure."""
    started = [(name, start, end, extra) for name, start, end, extra in phases if start is not None]
    for i, (name, start, end, extra) in enumerate(started):
        last = i == len(started) - 1
        span = tracer.start_span(name, context=parent, attributes={**attributes, **extra},
                                 start_time=epoch_ns(start))
        if last and failure is not None:
            message = failure if isinstance(failure, str) else f"{type(failure).__name__}: {failure}"
            kind = failure if isinstance(failure, str) else getattr(failure, "type", type(failure).__name__)
            span.set_attribute("error.type", kind)
            span.set_status(Status(StatusCode.ERROR, message))
        span.end(end_time=epoch_ns(end if end is not None else max(now, start)))
