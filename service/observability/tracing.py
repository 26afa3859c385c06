"""OpenTelemetry tracing: one SERVER span per HTTP request (`service.observability.request_span`), with child spans
for the scheduler's phases of its work (`service.observability.job_spans`). Off unless the standard `OTEL_*`
environment variables ask for it; when off, nothing of the SDK exists and the request path pays one
module-attribute check (`tracer is None`).

`configure_from_environment()` (called by `create_app`) follows the OpenTelemetry SDK environment-variable
specification, except that an unset exporter means "off" rather than "otlp": `OTEL_SDK_DISABLED`,
`OTEL_TRACES_EXPORTER` (`otlp` over HTTP/protobuf, `console`, `none`), else on when an OTLP endpoint variable is
set; the SDK reads the rest itself. Tests and embedders call `setup(exporter)`. The phases' times, stamped by the
schedulers, become epoch nanoseconds (`epoch_ns`) by one offset taken at setup.

Design notes (every variable): docs/architecture.md, service/observability/tracing.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext

from opentelemetry import trace

from service.observability import request_span
from service.observability.job_spans import OFF, JobSpans, Off

log = logging.getLogger(__name__)

DEFAULT_SERVICE_NAME = "tserve"
SERVICE_VERSION = "0.1.0"
INSTRUMENTATION = "service.observability.tracing"
EXPORTERS = ("otlp", "console")
FLUSH_TIMEOUT_S = 5.0  # how long `flush` waits for the buffered spans to be exported (at shutdown)
MS_PER_S = 1000  # the SDK's flush timeout counts milliseconds
NS_PER_S = 1_000_000_000  # time.monotonic() counts seconds, the spans nanoseconds

# The module's state: `tracer` is None while tracing is off (the check the request path makes).
tracer: trace.Tracer | None = None
_provider = None  # the SDK's TracerProvider, while on
_offset_ns = 0  # epoch ns - monotonic ns, taken once at setup


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


def flush(timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """Export the spans still buffered (at shutdown)."""
    if _provider is not None:
        _provider.force_flush(int(timeout_s * MS_PER_S))


def shutdown() -> None:
    """Export what is buffered and switch tracing off."""
    global tracer, _provider
    provider, tracer, _provider = _provider, None, None
    if provider is not None:
        provider.shutdown()


def epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as epoch nanoseconds (the spans' clock)."""
    return _offset_ns + int(monotonic_s * NS_PER_S)


# --- the spans (the request middleware, the serving layer) ------------------------------------------------------

def start_request(scope, headers: Mapping[bytes, bytes]) -> request_span.RequestSpan | None:
    """Start the SERVER span of an HTTP request (a child of its `traceparent`, if any) and make it current; None
    for the paths that are not traced. Only call while tracing is on (`tracer is not None`)."""
    return None if tracer is None else request_span.start(tracer, epoch_ns, scope, headers)


def start_rpc(method: str, metadata: Mapping[str, str], peer: str | None,
              request_id: str) -> request_span.RequestSpan | None:
    """Start the SERVER span of one gRPC request (`/package.Service/Method`; a child of its `traceparent` metadata,
    if any) and make it current. Only call while tracing is on (`tracer is not None`)."""
    return None if tracer is None else request_span.start_rpc(tracer, epoch_ns, method, metadata, peer, request_id)


def _current() -> trace.Tracer | None:
    """The tracer now (None once switched off): what a job's spans look at when they are recorded."""
    return tracer


def constraint_span(kind: str, cached: bool):
    """`with tracing.constraint_span(kind, cached):` a child span of the current one around a constraint's
    compilation (`service.serving.constrain`); nothing while tracing is off."""
    if tracer is None:
        return nullcontext()
    return tracer.start_as_current_span("constraint.compile", attributes={"tserve.constraint.kind": kind,
                                                                          "tserve.constraint.cached": cached})


def text_spans(loaded, jobs: Sequence) -> JobSpans | Off:
    """`with tracing.text_spans(loaded, jobs): <await the jobs>`: their queue_wait / prefill / decode spans."""
    return OFF if tracer is None else JobSpans(_current, epoch_ns, loaded, jobs, image=False)


def image_spans(loaded, job) -> JobSpans | Off:
    """`with tracing.image_spans(loaded, job): <await the job>`: its queue_wait / inference spans."""
    return OFF if tracer is None else JobSpans(_current, epoch_ns, loaded, [job], image=True)
