"""OpenTelemetry tracing (`service.observability.tracing`): when it is on and when it is off, which spans a request makes.

- The switch: the `OTEL_*` rule, without any app.
- In-process (TestClient over `create_app`, spans to the SDK's InMemorySpanExporter through `tracing.setup`): a
  generate, a beam translate, a classify and a streamed generate each make one SERVER span named after the route
  and, per scheduler job, the phase spans (queue_wait -> prefill -> decode; images queue_wait -> inference),
  children of the server span, back to back and within it, with their attributes; a `traceparent` makes the
  request part of the caller's trace; the access-log line carries the trace id; a request that fails ends its
  spans with an error status; with tracing off there is no span, no SDK object and no trace id in the log.
- Against an OTLP/HTTP endpoint the test runs itself: a real server process exports its spans there.
"""

from __future__ import annotations

import base64
import io
import itertools
import logging
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from PIL import Image

from service.client.sse import parse_sse
from service.observability import tracing
from service.settings import Settings
from tests.support.server import ServerProcess

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
TEXT_PHASES = ["queue_wait", "prefill", "decode"]
IMAGE_PHASES = ["queue_wait", "inference"]


# --- the switch -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("env, exporters", [
    ({}, []),
    ({"OTEL_SERVICE_NAME": "x"}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "console, otlp"}, ["console", "otlp"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, []),
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, []),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
], ids=["nothing", "service-name-only", "endpoint", "traces-endpoint", "exporter", "two-exporters", "none-wins",
        "unsupported", "sdk-disabled"])
def test_tracing_is_switched_on_by_the_otel_variables(env, exporters):
    assert tracing.exporters_from_environment(env) == exporters


def test_off_by_default_creates_nothing(monkeypatch):
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tracing, "tracer", None)  # as at startup (and put back after the test)
    monkeypatch.setattr(tracing, "_provider", None)
    assert tracing.configure_from_environment() is False
    assert tracing.tracer is None and tracing._provider is None
    with tracing.text_spans(None, []) as spans:  # the serving layer's calls cost a check
        spans.record()


# --- in-process -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exporter():
    exporter = InMemorySpanExporter()
    tracing.setup(exporter)
    yield exporter
    tracing.shutdown()


@pytest.fixture(scope="module")
def client(tiny_repository, serving, exporter):
    settings = Settings(repository=tiny_repository, max_new_tokens=120, max_timeout_ms=60_000)
    with serving(settings) as client:
        yield client


@pytest.fixture
def spans(exporter, client):
    """The exporter, emptied: what a test's requests make."""
    exporter.clear()
    return exporter


@pytest.fixture
def access_log(caplog):
    caplog.set_level(logging.INFO, logger="tserve.access")
    return lambda: [r.fields for r in caplog.records if r.name == "tserve.access"]


def hex_id(value: int, digits: int) -> str:
    return format(value, f"0{digits}x")


def request_tree(exporter: InMemorySpanExporter, name: str):
    """The one request's server span (named `name`) and its children, checked to nest within it; the children by
    job index."""
    finished = exporter.get_finished_spans()
    servers = [s for s in finished if s.kind is SpanKind.SERVER]
    assert [s.name for s in servers] == [name], [s.name for s in finished]
    server = servers[0]
    jobs = defaultdict(list)
    for span in finished:
        if span is server:
            continue
        assert span.kind is SpanKind.INTERNAL
        assert span.context.trace_id == server.context.trace_id
        assert span.parent is not None and span.parent.span_id == server.context.span_id
        assert server.start_time <= span.start_time <= span.end_time <= server.end_time, span.name
        jobs[span.attributes.get("tserve.job", 0)].append(span)
    return server, {job: sorted(group, key=lambda s: s.start_time) for job, group in jobs.items()}


def check_server_span(server, method: str, route: str, status: int, model: str) -> None:
    attributes = server.attributes
    assert attributes["http.request.method"] == method
    assert attributes["http.route"] == route and attributes["url.path"] == route
    assert attributes["http.response.status_code"] == status
    assert attributes["tserve.model"] == model and attributes["tserve.version"] == 1
    assert attributes["tserve.request_id"]
    assert server.status.status_code is (StatusCode.UNSET if status < 500 else StatusCode.ERROR)


def check_phases(phases, names: list[str], **attributes) -> None:
    """The phases in order, back to back (each starts where the one before ended), each with `attributes`."""
    assert [s.name for s in phases] == names
    for before, after in itertools.pairwise(phases):
        assert before.end_time == after.start_time, (before.name, after.name)
    for span in phases:
        for key, value in attributes.items():
            assert span.attributes[f"tserve.{key}"] == value, (span.name, key)


@pytest.mark.slow
def test_generate_makes_a_server_span_and_the_phase_spans(client, spans, access_log):
    response = client.post("/v1/generate", json={"prompt": "ROMEO:\n", "temperature": 0, "max_new_tokens": 12})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    server, jobs = request_tree(spans, "POST /v1/generate")
    check_server_span(server, "POST", "/v1/generate", 200, "gpt")
    assert server.attributes["tserve.mode"] == "greedy"
    assert list(jobs) == [0]
    check_phases(jobs[0], TEXT_PHASES, model="gpt", version=1, mode="greedy", rows=1,
                 prompt_tokens=usage["prompt_tokens"], generated_tokens=usage["completion_tokens"])
    assert all(s.status.status_code is StatusCode.UNSET for s in jobs[0])
    (line,) = access_log()
    assert line["trace_id"] == hex_id(server.context.trace_id, 32)
    assert line["request_id"] == server.attributes["tserve.request_id"] == response.headers["x-request-id"]


@pytest.mark.slow
def test_beam_translation_of_two_texts_makes_phase_spans_per_text(client, spans):
    texts = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee."]
    response = client.post("/v1/translate", json={"text": texts, "num_beams": 3, "num_return_sequences": 2})
    assert response.status_code == 200, response.text
    server, jobs = request_tree(spans, "POST /v1/translate")
    check_server_span(server, "POST", "/v1/translate", 200, "translation")
    engine = client.app.state.registry.resolve("translation", None, None).engine
    assert sorted(jobs) == [0, 1]
    for job, text in enumerate(texts):
        check_phases(jobs[job], TEXT_PHASES, model="translation", version=1, mode="beam", rows=3,
                     prompt_tokens=len(engine.source_ids(text)))
        assert jobs[job][0].attributes["tserve.generated_tokens"] >= 1


@pytest.mark.slow
def test_classify_makes_queue_wait_and_inference_spans(client, spans):
    buffer = io.BytesIO()
    Image.new("L", (28, 28), 100).save(buffer, "PNG")
    image = base64.b64encode(buffer.getvalue()).decode()
    response = client.post("/v1/classify", json={"images": [image, image, image]})
    assert response.status_code == 200, response.text
    server, jobs = request_tree(spans, "POST /v1/classify")
    check_server_span(server, "POST", "/v1/classify", 200, "vit")
    check_phases(jobs[0], IMAGE_PHASES, model="vit", version=1, mode="classify", images=3)
    assert jobs[0][1].attributes["tserve.batch_size"] >= 3


@pytest.mark.slow
def test_a_streamed_generate_makes_the_same_spans(client, spans, access_log):
    body = {"prompt": "JULIET:\n", "temperature": 0, "max_new_tokens": 10, "stream": True}
    with client.stream("POST", "/v1/generate", json=body) as response:
        events = parse_sse(response.read().decode())
    assert response.status_code == 200
    usage = events[-1]["usage"]
    server, jobs = request_tree(spans, "POST /v1/generate")
    check_server_span(server, "POST", "/v1/generate", 200, "gpt")
    check_phases(jobs[0], TEXT_PHASES, model="gpt", version=1, mode="greedy", rows=1,
                 prompt_tokens=usage["prompt_tokens"], generated_tokens=usage["completion_tokens"])
    assert all(s.status.status_code is StatusCode.UNSET for s in [server, *jobs[0]])
    assert access_log()[-1]["trace_id"] == hex_id(server.context.trace_id, 32)


@pytest.mark.slow
def test_a_traceparent_makes_the_request_part_of_the_callers_trace(client, spans, access_log):
    response = client.post("/v1/generate", json={"prompt": "O, ", "temperature": 0, "max_new_tokens": 4},
                           headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1"})
    assert response.status_code == 200, response.text
    server, jobs = request_tree(spans, "POST /v1/generate")
    assert hex_id(server.context.trace_id, 32) == TRACE_ID
    assert server.parent is not None and server.parent.is_remote
    assert hex_id(server.parent.span_id, 16) == PARENT_SPAN_ID
    assert server.context.trace_state.get("vendor") == "1"
    assert [s.name for s in jobs[0]] == TEXT_PHASES  # checked to be in the same trace by request_tree
    assert access_log()[-1]["trace_id"] == TRACE_ID


@pytest.mark.slow
def test_a_failed_request_ends_its_spans_with_an_error(client, spans):
    # seconds of work (32 texts x 8 beams, each forced to 120 tokens) against a 30 ms deadline: a 504
    texts = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Kinder laufen am Strand."] * 10
    body = {"text": texts, "num_beams": 8, "max_new_tokens": 120, "min_new_tokens": 120, "timeout_ms": 30}
    response = client.post("/v1/translate", json=body)
    assert response.status_code == 504, response.text
    server, jobs = request_tree(spans, "POST /v1/translate")
    check_server_span(server, "POST", "/v1/translate", 504, "translation")
    assert server.attributes["error.type"] == "504"
    assert sorted(jobs) == list(range(len(texts)))
    for phases in jobs.values():  # each job got as far as it got; the phase it was in failed
        assert [s.name for s in phases] == TEXT_PHASES[: len(phases)]
        assert all(s.status.status_code is StatusCode.UNSET for s in phases[:-1])
        assert phases[-1].status.status_code is StatusCode.ERROR and phases[-1].attributes["error.type"]


@pytest.mark.slow
def test_probes_and_metrics_are_not_traced(client, spans):
    for path in ("/health/live", "/health/ready", "/metrics"):
        assert client.get(path).status_code == 200
    assert client.get("/v1/models").status_code == 200
    assert [s.name for s in spans.get_finished_spans()] == ["GET /v1/models"]


@pytest.mark.slow
def test_with_tracing_off_there_is_no_span_and_no_trace_id(client, spans, access_log):
    tracing.shutdown()
    try:
        assert tracing.tracer is None and tracing._provider is None
        response = client.post("/v1/generate", json={"prompt": "O, ", "temperature": 0, "max_new_tokens": 4},
                               headers={"traceparent": TRACEPARENT})
        assert response.status_code == 200, response.text
        assert spans.get_finished_spans() == ()
        (line,) = access_log()
        assert "trace_id" not in line and line["status"] == 200
    finally:
        tracing.setup(spans)


# --- a real process exporting over OTLP/HTTP --------------------------------------------------------------------

class Collector:
    """An OTLP/HTTP trace receiver on a free loopback port: POST /v1/traces (protobuf) -> `requests`."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.requests: list = []
        received = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path != "/v1/traces" or self.headers.get("content-type") != "application/x-protobuf":
                    self.send_error(404 if self.path != "/v1/traces" else 415)
                    return
                received.append(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def spans(self) -> list[tuple[dict, object]]:
        """(resource attributes, span) for every span received."""
        out = []
        for request in list(self.requests):
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                out.extend((resource, span) for scope in resource_spans.scope_spans for span in scope.spans)
        return out


@pytest.mark.slow
def test_a_server_process_exports_its_spans_over_otlp_http(tiny_repository, tmp_path, monkeypatch):
    with Collector() as collector:
        # the child's environment is this process's (without TSERVE_*): the standard variables switch tracing on
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
        monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
        server = ServerProcess("traced server", tiny_repository, tmp_path, models='["gpt"]').start()
        try:
            import httpx

            with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as client:
                response = client.post("/v1/generate", json={"prompt": "ROMEO:\n", "temperature": 0,
                                                             "max_new_tokens": 8},
                                       headers={"traceparent": TRACEPARENT})
            assert response.status_code == 200, response.text
            request_id = response.headers["x-request-id"]
            deadline = time.monotonic() + 30
            while {"POST /v1/generate", "decode"} - {span.name for _, span in collector.spans()}:
                assert time.monotonic() < deadline, [span.name for _, span in collector.spans()]
                time.sleep(0.05)
            received = collector.spans()
            ours = [(resource, span) for resource, span in received if span.trace_id.hex() == TRACE_ID]
            assert sorted(span.name for _, span in ours) == sorted(["POST /v1/generate", *TEXT_PHASES])
            (server_span,) = [span for _, span in ours if span.name == "POST /v1/generate"]
            assert server_span.parent_span_id.hex() == PARENT_SPAN_ID
            assert all(span.parent_span_id == server_span.span_id for _, span in ours if span is not server_span)
            assert all(resource["service.name"] == "tserve" for resource, _ in ours)
            poll_until = time.monotonic() + 10
            while not server.access_records(request_id) and time.monotonic() < poll_until:
                time.sleep(0.05)
            assert server.access_records(request_id)[0]["trace_id"] == TRACE_ID
        finally:
            server.stop()
