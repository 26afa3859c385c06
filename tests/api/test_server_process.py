"""End-to-end tests against a real server process: `python -m service` (uvicorn) on the tiny model repository,
driven over HTTP with httpx.

One shared server serves the batching, streaming, cancellation, deadline and access-log tests; the overload,
SIGTERM and port-in-use tests start their own short-lived servers with different knobs. Every wait is a bounded poll,
every server is terminated at teardown, and a failing test prints what its servers wrote (stdout: JSON log lines).

Timing notes (the tiny models are fast: a 60-token GPT generation takes ~20 ms on CPU):
- a non-streamed request is only noticed as cancelled at the route's 0.2 s disconnect poll, so the client-timeout
  cancellation uses a translate request that takes seconds (32 sentences x 8 beams x 120 forced tokens);
- the in-flight requests of the SIGTERM test are such translate requests as well: a generate request cannot last
  past the 1 s drain delay.
"""

from __future__ import annotations

import json
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import pytest

from service.__main__ import EXIT_CANNOT_LISTEN
from service.client.launcher import ServiceProcess
from service.client.processes import LOOPBACK, free_port
from service.client.sse import parse_sse
from tests.support.metrics import metric, scrape
from tests.support.server import ServerProcess
from tests.support.waiting import poll

pytestmark = pytest.mark.slow

GPT_CONTEXT = 64  # the tiny gpt preset's context, in (byte-level) tokens

PROMPTS = ["ROMEO:\n", "JULIET:\n", "First Citizen:\n", "KING HENRY V:\n", "To be, or not", "What say you",
           "My lord,", "O, ", "Good morrow", "HAMLET:\n", "Thou art", "I pray you", "MENENIUS:\n", "And then",
           "Nay, but", "Come hither"]
GERMAN = "Ein Mann fährt Fahrrad."
# A translate request that takes seconds on the tiny model: 32 jobs x 8 beam rows, every one forced to 120 steps.
HEAVY_TRANSLATE = {"text": [GERMAN, "Zwei Hunde spielen im Schnee.", "Kinder laufen am Strand.",
                            "Eine Frau in einem roten Kleid singt."] * 8,
                   "num_beams": 8, "max_new_tokens": 120, "min_new_tokens": 120}


@pytest.fixture(scope="module")
def server(server_factory):
    """The shared server: every model of the tiny repository, default settings."""
    with server_factory("shared server") as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30, limits=httpx.Limits(max_connections=64)) as c:
        yield c


# --- helpers --------------------------------------------------------------------------------------------------

def assert_error(response: httpx.Response, status: int, error_type: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}, body
    assert body["error"]["type"] == error_type, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return body


def stream(client: httpx.Client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        raw = response.read().decode("utf-8")
    assert response.status_code == 200, raw
    assert response.headers["content-type"].startswith("text/event-stream")
    return parse_sse(raw)


def check_token_events(events: list[dict], final_keys: set[str]) -> str:
    """Consecutive indices, token events then one final event with `final_keys`; returns the concatenated text."""
    assert events, "no events before [DONE]"
    assert [e.get("index") for e in events] == list(range(len(events))), events
    for event in events[:-1]:
        assert set(event) == {"token", "index"}, event
    assert set(events[-1]) == {"token", "index"} | final_keys, events[-1]
    assert all(isinstance(e["token"], str) for e in events)
    return "".join(e["token"] for e in events)


# --- 1. continuous batching -----------------------------------------------------------------------------------

def test_concurrent_greedy_generates_are_batched_and_match_sequential_results(client):
    def body(prompt):
        return {"prompt": prompt, "temperature": 0, "max_new_tokens": 24}

    barrier = threading.Barrier(len(PROMPTS))

    def send(prompt):
        barrier.wait(timeout=30)
        return client.post("/v1/generate", json=body(prompt))

    before = scrape(client)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(send, PROMPTS))
    after = scrape(client)
    assert [r.status_code for r in together] == [200] * len(PROMPTS), [r.text for r in together]

    alone = [client.post("/v1/generate", json=body(prompt)) for prompt in PROMPTS]
    assert [r.status_code for r in alone] == [200] * len(PROMPTS)
    for prompt, batched, single in zip(PROMPTS, together, alone):
        assert batched.json()["text"] == single.json()["text"], prompt
        assert batched.json()["usage"] == single.json()["usage"], prompt
        assert batched.json()["finish_reason"] == single.json()["finish_reason"], prompt

    def delta(name, **labels):
        return metric(after, name, model="gpt", **labels) - metric(before, name, model="gpt", **labels)

    steps, rows = delta("tserve_batch_size_count"), delta("tserve_batch_size_sum")
    single_row_steps = delta("tserve_batch_size_bucket", le="1.0")
    assert steps > 0
    assert rows > steps, f"every decoding step ran a single row ({rows} rows in {steps} steps)"
    assert single_row_steps < steps


# --- 2. streaming -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body", [
    {"prompt": "ROMEO:\n", "temperature": 0, "max_new_tokens": 40},
    {"prompt": "First Citizen:\n", "temperature": 0.9, "top_k": 40, "seed": 1234, "max_new_tokens": 48},
], ids=["greedy", "sampling-seeded"])
def test_streamed_generate_equals_non_streamed(client, body):
    response = client.post("/v1/generate", json=body)
    assert response.status_code == 200, response.text
    expected = response.json()

    events = stream(client, "/v1/generate", body)
    assert check_token_events(events, {"finish_reason", "usage"}) == expected["text"]
    assert events[-1]["finish_reason"] == expected["finish_reason"]
    assert events[-1]["usage"] == expected["usage"]
    # one event per generated token, plus the final one (EOS is not a token of the text)
    assert len(events) == expected["usage"]["completion_tokens"] + 1


def test_streamed_translate_equals_non_streamed(client):
    body = {"text": GERMAN, "num_beams": 1}
    response = client.post("/v1/translate", json=body)
    assert response.status_code == 200, response.text
    expected = response.json()["translations"][0][0]

    events = stream(client, "/v1/translate", body)
    assert check_token_events(events, {"finish_reason", "score"}) == expected["text"]
    assert events[-1]["finish_reason"] in ("eos", "length")
    assert events[-1]["score"] == pytest.approx(expected["score"], rel=1e-6, abs=1e-6)


def _stop_request(client, kind: str) -> tuple[dict, str]:
    """A greedy request with a stop string that the unconstrained continuation contains (not at its start), and
    the text expected with it: the continuation cut before the stop string's first occurrence."""
    body = {"prompt": "ROMEO:\n", "temperature": 0, "max_new_tokens": 40}
    response = client.post("/v1/generate", json=body)
    assert response.status_code == 200, response.text
    text = response.json()["text"]
    if kind == "char":
        candidates = ["\n", "e", " ", "t", "o", "a", *text[1:]]
    else:
        candidates = [text[i:i + 3] for i in range(1, len(text) - 2)]
    stop = next((s for s in candidates if text.find(s) >= 1), None)
    assert stop is not None, f"no usable stop string in {text!r}"
    return {**body, "stop": [stop]}, text[:text.find(stop)]


@pytest.mark.parametrize("kind", ["char", "multi-char"])
def test_stop_string_non_streamed(client, kind):
    body, expected_text = _stop_request(client, kind)
    response = client.post("/v1/generate", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["finish_reason"] == "stop"
    assert response.json()["text"] == expected_text


@pytest.mark.parametrize("kind", ["char", "multi-char"])
def test_stop_string_streamed_equals_non_streamed(client, kind):
    body, expected_text = _stop_request(client, kind)
    response = client.post("/v1/generate", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["finish_reason"] == "stop"

    events = stream(client, "/v1/generate", body)
    assert events[-1]["finish_reason"] == "stop"
    assert check_token_events(events, {"finish_reason", "usage"}) == expected_text


# --- 3. a client that goes away frees its rows ------------------------------------------------------------------

def _running(client, model):
    return metric(scrape(client), "tserve_running_requests", model=model)


def _cancelled(samples, model):
    return metric(samples, "tserve_request_failures_total", model=model, reason="cancelled")


def test_closing_a_stream_cancels_the_request_and_frees_its_rows(client):
    prompt = "ROMEO:\n"
    max_new = GPT_CONTEXT - len(prompt.encode())  # as long as the tiny context allows
    body = {"prompt": prompt, "temperature": 0, "max_new_tokens": max_new, "stream": True}
    # what the token counter says for the same request run to its end (the greedy continuation never hits EOS)
    before = scrape(client)
    full = client.post("/v1/generate", json={**body, "stream": False})
    assert full.status_code == 200 and full.json()["finish_reason"] == "length", full.text
    full_count = (metric(scrape(client), "tserve_generated_tokens_total", model="gpt")
                  - metric(before, "tserve_generated_tokens_total", model="gpt"))
    # The tiny model generates all tokens in ~20 ms, so the generation may win the race against the close:
    # retry a few times; a run that finished normally has not cancelled anything.
    for _attempt in range(5):
        before = scrape(client)
        with client.stream("POST", "/v1/generate", json=body) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events == 2:
                        break
        # leaving the block without reading to the end closes the connection

        def settled():
            samples = scrape(client)
            return samples if metric(samples, "tserve_running_requests", model="gpt") == 0 else None

        after = poll(settled, timeout=2.0, message="tserve_running_requests{model=gpt} == 0")
        if _cancelled(after, "gpt") > _cancelled(before, "gpt"):
            break
    else:
        pytest.fail("5 closed streams, none counted as cancelled")
    assert _cancelled(after, "gpt") - _cancelled(before, "gpt") == 1
    # decoding stopped early: fewer tokens than the same request run to its end
    generated = (metric(after, "tserve_generated_tokens_total", model="gpt")
                 - metric(before, "tserve_generated_tokens_total", model="gpt"))
    assert 1 <= generated < full_count
    assert metric(after, "tserve_queue_depth", model="gpt") == 0
    # and the model still serves
    assert client.post("/v1/generate", json={**body, "stream": False, "max_new_tokens": 8}).status_code == 200


def test_client_timeout_cancels_a_non_streamed_request_and_frees_its_rows(client):
    before = scrape(client)
    with pytest.raises(httpx.TimeoutException):
        client.post("/v1/translate", json=HEAVY_TRANSLATE, timeout=httpx.Timeout(30, read=0.5))

    def settled():  # the route polls for a disconnect every 0.2 s; rows are freed at the next step
        samples = scrape(client)
        done = (metric(samples, "tserve_running_requests", model="translation") == 0
                and metric(samples, "tserve_queue_depth", model="translation") == 0
                and _cancelled(samples, "translation") > _cancelled(before, "translation"))
        return samples if done else None

    after = poll(settled, timeout=2.5, message="the translation rows freed and the request counted as cancelled")
    cancelled = _cancelled(after, "translation") - _cancelled(before, "translation")
    assert 1 <= cancelled <= len(HEAVY_TRANSLATE["text"])  # one per sentence job that had not finished
    assert client.post("/v1/translate", json={"text": GERMAN, "num_beams": 2}).status_code == 200


# --- 5. deadlines ---------------------------------------------------------------------------------------------

def test_expired_deadline_is_a_504(client):
    before = scrape(client)
    response = client.post("/v1/generate", json={"prompt": "ROMEO:\n", "max_new_tokens": 56, "timeout_ms": 1})
    assert_error(response, 504, "timeout")
    after = scrape(client)
    timeouts = (metric(after, "tserve_request_failures_total", model="gpt", reason="timeout")
                - metric(before, "tserve_request_failures_total", model="gpt", reason="timeout"))
    assert timeouts == 1


def test_expired_deadline_while_streaming_ends_with_an_error_event(client):
    events = stream(client, "/v1/generate", {"prompt": "ROMEO:\n", "max_new_tokens": 56, "timeout_ms": 1})
    assert events[-1]["error"]["type"] == "timeout", events[-1]
    assert [e["index"] for e in events[:-1]] == list(range(len(events) - 1))


def test_prompt_beyond_the_context_is_a_400_and_the_full_context_is_fine(client):
    prompt = "ROMEO:\n"
    fits = client.post("/v1/generate", json={"prompt": prompt, "temperature": 0,
                                             "max_new_tokens": GPT_CONTEXT - len(prompt)})
    assert fits.status_code == 200, fits.text
    assert_error(client.post("/v1/generate", json={"prompt": prompt, "max_new_tokens": GPT_CONTEXT - len(prompt) + 1}),
                 400, "bad_input")


# --- 7. access log and request ids ----------------------------------------------------------------------------

def test_access_log_has_one_json_line_per_request_and_the_request_id(server, client):
    given = client.post("/v1/generate", json={"prompt": "ROMEO:\n", "max_new_tokens": 4},
                        headers={"X-Request-ID": "test-123"})
    assert given.status_code == 200
    assert given.headers["x-request-id"] == "test-123"

    generated = client.post("/v1/translate", json={"text": GERMAN, "num_beams": 1})
    assert generated.status_code == 200
    generated_id = generated.headers["x-request-id"]
    assert generated_id and generated_id != "test-123"

    invalid = client.post("/v1/generate", json={"prompt": "", "max_new_tokens": 4},
                          headers={"X-Request-ID": "not a safe id!"})
    assert_error(invalid, 422, "invalid_request")
    invalid_id = invalid.headers["x-request-id"]
    assert invalid_id != "not a safe id!"  # unsafe ids are replaced, not echoed

    ids = ["test-123", generated_id, invalid_id]
    poll(lambda: all(server.access_records(i) for i in ids), timeout=5, message="the access log lines")
    expected = {"test-123": ("/v1/generate", 200, "gpt"), generated_id: ("/v1/translate", 200, "translation"),
                invalid_id: ("/v1/generate", 422, None)}
    for request_id, (path, status, model) in expected.items():
        records = server.access_records(request_id)
        assert len(records) == 1, records
        record = records[0]
        assert record["method"] == "POST" and record["path"] == path
        assert record["status"] == status
        assert record["model"] == model
        assert isinstance(record["latency_ms"], (int, float)) and record["latency_ms"] >= 0
        assert record["level"] == "info" and record["time"].endswith("Z")

    # TSERVE_LOG_FORMAT=json: every line on stdout is one JSON object
    not_json = [line for line in server.stdout if line.strip() and not _is_json_object(line)]
    assert not_json == []


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False




def test_shared_server_logged_no_errors(server, client):
    """Whatever the tests above did (cancellations, timeouts, bad input), nothing was an unhandled error."""
    assert client.get("/health/ready").status_code == 200
    problems = [r for r in server.log_records() if r.get("level") in ("error", "critical") or "exception" in r]
    assert problems == []
    statuses = [r["status"] for r in server.access_records()]
    assert statuses and not [s for s in statuses if s >= 500 and s not in (503, 504)]


# --- 4. overload: 429 with Retry-After, never a 5xx -------------------------------------------------------------

def test_overload_is_429_with_retry_after_and_never_5xx(tiny_repository, tmp_path):
    process = ServerProcess("overload server", tiny_repository, tmp_path, models='["gpt"]', max_queue_size=2,
                            gpt_max_batch_rows=2, max_prefill_requests=1)
    try:
        process.start()
        n = 40
        body = {"prompt": "ROMEO:\n", "temperature": 0, "max_new_tokens": 48}
        barrier = threading.Barrier(n)

        with httpx.Client(base_url=process.url, timeout=60, limits=httpx.Limits(max_connections=n)) as c:
            def send(i):
                barrier.wait(timeout=30)
                if i % 4 == 3:  # a quarter streamed: a full queue is a 429 before the stream starts
                    with c.stream("POST", "/v1/generate", json={**body, "stream": True}) as response:
                        response.read()
                    return response
                return c.post("/v1/generate", json=body)

            with ThreadPoolExecutor(n) as pool:
                responses = list(pool.map(send, range(n)))

            statuses = [r.status_code for r in responses]
            assert set(statuses) <= {200, 429}, statuses
            rejected = [r for r in responses if r.status_code == 429]
            assert rejected, "40 concurrent requests against a queue of 2 were all accepted"
            assert 200 in statuses
            for response in rejected:
                assert_error(response, 429, "queue_full")
                retry_after = response.headers.get("retry-after")
                assert retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1, retry_after
            for i, response in enumerate(responses):
                if response.status_code == 200 and i % 4 == 3:
                    events = parse_sse(response.text)
                    assert "error" not in events[-1] and events[-1]["finish_reason"] == "length"
                elif response.status_code == 200:
                    assert response.json()["usage"]["completion_tokens"] == body["max_new_tokens"]

            samples = scrape(c)
            assert metric(samples, "tserve_request_failures_total", model="gpt", reason="queue_full") == len(rejected)
            assert metric(samples, "tserve_queue_depth", model="gpt") == 0
            assert c.post("/v1/generate", json=body).status_code == 200  # and it recovers
    finally:
        process.stop()


# --- 6. SIGTERM: readiness 503, in-flight requests finish, the process exits ------------------------------------

DRAIN_DELAY_S = 1.0
IN_FLIGHT = 3


@dataclass
class DrainRun:
    returncode: int | None = None
    exit_seconds: float | None = None  # after SIGTERM
    readiness: list[tuple[int, dict]] = field(default_factory=list)  # polls right after SIGTERM
    during_delay: httpx.Response | None = None
    in_flight: list = field(default_factory=list)  # (response or exception, seconds after SIGTERM)
    after_delay: list[str] = field(default_factory=list)  # "503", "connect_error", "disconnected", other statuses
    output: str = ""


@pytest.fixture(scope="module")
def drain_run(server_factory) -> DrainRun:
    """Start a server, put IN_FLIGHT long translate requests in flight, SIGTERM it and record what happens."""
    run = DrainRun()
    process = server_factory("drain server", models='["translation"]', drain_delay_s=DRAIN_DELAY_S)
    try:
        process.start()
        with httpx.Client(base_url=process.url, timeout=60) as c:
            jobs_expected = IN_FLIGHT * len(HEAVY_TRANSLATE["text"])
            pool = ThreadPoolExecutor(IN_FLIGHT)

            def long_request(_):
                with httpx.Client(base_url=process.url, timeout=60) as own:
                    try:
                        result = own.post("/v1/translate", json=HEAVY_TRANSLATE)
                    except httpx.HTTPError as error:
                        result = error
                return result, time.monotonic()

            futures = [pool.submit(long_request, i) for i in range(IN_FLIGHT)]

            def accepted():  # every sentence job of every request is queued or running
                samples = scrape(c)
                return (metric(samples, "tserve_running_requests", model="translation")
                        + metric(samples, "tserve_queue_depth", model="translation")) >= jobs_expected

            poll(accepted, timeout=15, interval=0.01, message="the in-flight requests to be accepted")

            process.send_signal(signal.SIGTERM)
            sigterm_at = time.monotonic()

            def readiness_flipped():
                response = c.get("/health/ready")
                run.readiness.append((response.status_code, response.json()))
                return response.status_code == 503

            poll(readiness_flipped, timeout=DRAIN_DELAY_S * 0.8, interval=0.01, message="/health/ready == 503")
            run.during_delay = c.post("/v1/translate", json={"text": GERMAN, "num_beams": 1})

            # after the delay: new connections are refused while the in-flight requests finish
            while not all(f.done() for f in futures) and process.proc.poll() is None:
                if time.monotonic() > sigterm_at + 60:
                    break
                try:
                    response = httpx.post(f"{process.url}/v1/translate", json={"text": GERMAN, "num_beams": 1},
                                          timeout=10, headers={"Connection": "close"})
                    outcome = str(response.status_code)
                except httpx.ConnectError:
                    outcome = "connect_error"
                except (httpx.RemoteProtocolError, httpx.ReadError):
                    outcome = "disconnected"
                if time.monotonic() > sigterm_at + DRAIN_DELAY_S + 0.2:
                    run.after_delay.append(outcome)
                time.sleep(0.05)

            run.in_flight = [(r, t - sigterm_at) for r, t in (f.result(timeout=70) for f in futures)]
            pool.shutdown()
            run.returncode = process.wait(timeout=45)
            if run.returncode is not None:
                run.exit_seconds = time.monotonic() - sigterm_at
    finally:
        process.stop()
        run.output = process.output()
    return run


def test_sigterm_drains_in_flight_requests(drain_run):
    run = drain_run
    # readiness flips to 503 (with the reason) at once, while requests in flight continue
    status, body = run.readiness[-1]
    assert status == 503 and any("draining" in reason for reason in body["reasons"]), run.readiness
    assert all(s in (200, 503) for s, _ in run.readiness)
    # new requests during the delay: 503, JSON error
    assert_error(run.during_delay, 503, "unavailable")
    # every in-flight request completes, and at least one only after the drain delay: shutdown waited for it
    for result, _seconds in run.in_flight:
        assert isinstance(result, httpx.Response), repr(result)
        assert result.status_code == 200, result.text
        assert len(result.json()["translations"]) == len(HEAVY_TRANSLATE["text"])
    assert max(seconds for _, seconds in run.in_flight) > DRAIN_DELAY_S, run.in_flight
    # after the delay: connections are refused (or closed), never a 5xx other than 503, never served
    assert run.after_delay, "the in-flight requests finished before the drain delay was over; make them longer"
    assert set(run.after_delay) <= {"503", "connect_error", "disconnected"}, run.after_delay
    assert "connect_error" in run.after_delay, run.after_delay
    # and the process exits soon after the last of them
    assert run.returncode is not None and run.exit_seconds < 45, run.output
    messages = [json.loads(line).get("message", "") for line in run.output.splitlines() if _is_json_object(line)]
    assert any(m.startswith("SIGTERM: draining") for m in messages)


def test_sigterm_exit_status_is_zero(drain_run):
    assert drain_run.returncode == 0, (drain_run.returncode, drain_run.output[-2000:])


# --- 8. a port in use: the same clean exit every time, naming the port ------------------------------------------

PORT_IN_USE_STARTS = 3  # before the fix, 5 starts of 18 aborted (exit 134) instead of exiting
EXIT_WAIT_S = 90.0  # a start that fails at once exits within the imports' time; a bound, not a pace


@pytest.mark.parametrize("protocol, reuse_port", [("http", False), ("grpc", False), ("grpc", True)],
                         ids=["http", "grpc", "grpc-taken-by-a-grpc-server"])
def test_a_port_in_use_is_the_same_clean_exit_naming_the_port(tiny_repository, tmp_path, protocol, reuse_port):
    """With TSERVE_PORT or TSERVE_GRPC_PORT taken (for the gRPC port also by a listener with SO_REUSEPORT, as
    another gRPC server's), `python -m service` exits with EXIT_CANNOT_LISTEN and one error line naming the port,
    every time: it checks its ports before any model loads or any thread starts."""
    with socket.create_server((LOOPBACK, 0), reuse_port=reuse_port) as holder:
        taken = holder.getsockname()[1]
        ports = {"port": taken, "grpc_port": free_port()} if protocol == "http" else {"port": free_port(),
                                                                                     "grpc_port": taken}
        setting = "HTTP, TSERVE_PORT" if protocol == "http" else "gRPC, TSERVE_GRPC_PORT"
        for start in range(PORT_IN_USE_STARTS):
            # `command`: the launcher's own choice of TSERVE_PORT does not override the one given here
            process = ServiceProcess(f"{protocol} port in use, start {start}", tiny_repository, tmp_path,
                                     command=lambda _port: [sys.executable, "-m", "service"], host=LOOPBACK,
                                     log_format="json", log_level="INFO", **ports)
            try:
                status = process.spawn().wait(timeout=EXIT_WAIT_S)
            finally:
                process.stop()
            assert status == EXIT_CANNOT_LISTEN, process.output()
            errors = [r["message"] for r in process.log_records() if r.get("level") == "error"]
            assert errors == [f"cannot listen on {LOOPBACK}:{taken} ({setting}): address already in use"], \
                process.output()
