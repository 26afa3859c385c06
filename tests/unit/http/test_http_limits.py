"""Slow and oversized request heads against a real server process (`python -m service`, service.http.limits),
driven over raw sockets: 408 for a head not complete within header_timeout_s, 431 for a head over
max_header_bytes (stopped while it streams in) or with over max_header_count headers, a JSON 400 for a request the
parser cannot read (raw non-ASCII path bytes), the connection closed, the rejection counted in
`tserve_rejected_connections_total{reason}`, and the server still ready afterwards.

Timing: every wait is bounded and generous (the machine may be loaded); lower bounds check that a limit is not
enforced early.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import select
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from service.client.processes import free_port
from service.http.limits import limited_http_protocol
from service.settings import Settings
from tests.support.waiting import poll

pytestmark = pytest.mark.slow

HEADER_TIMEOUT_S = 1.0
MAX_HEADER_BYTES = 4096
MAX_HEADER_COUNT = 20
MARGIN_S = 5.0  # on top of a limit: how late an answer may be on a loaded machine
EARLY_S = 0.1  # a timeout may fire this much before its nominal time (timer and clock granularity)
REJECTED = "tserve_rejected_connections_total"


@pytest.fixture(scope="module")
def server(server_factory):
    with server_factory("limits server", models='["gpt"]', header_timeout_s=HEADER_TIMEOUT_S,
                        max_header_bytes=MAX_HEADER_BYTES, max_header_count=MAX_HEADER_COUNT,
                        drain_delay_s=0) as process:
        yield process


# --- raw HTTP/1.1 over a socket ----------------------------------------------------------------------------------

class Connection:
    """A client socket that reads whole responses (content-length bodies) and notices the server closing."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.opened = time.monotonic()
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> bool:
        """False when the server has closed the connection already."""
        try:
            self.sock.sendall(data)
            return True
        except OSError:  # EPIPE / ECONNRESET after a rejection
            return False

    def _fill(self, deadline: float) -> bool:
        """Read what is there, waiting until `deadline`; False at end of stream."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("no response in time")
        self.sock.settimeout(remaining)
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            data = b""
        except TimeoutError as error:
            raise TimeoutError("no response in time") from error
        self.buffer += data
        return bool(data)

    def response(self, timeout: float) -> tuple[int, dict[str, str], bytes]:
        """The next response: status, headers (lower-case names), body."""
        deadline = time.monotonic() + timeout
        while b"\r\n\r\n" not in self.buffer:
            assert self._fill(deadline), f"connection closed before a response: {self.buffer!r}"
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            assert self._fill(deadline), "connection closed in the middle of a body"
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return int(status_line.split()[1]), headers, body

    def closed_by_server(self, timeout: float = MARGIN_S) -> bool:
        deadline = time.monotonic() + timeout
        while self._fill(deadline):
            pass
        return True

    def readable(self, timeout: float) -> bool:
        return bool(select.select([self.sock], [], [], timeout)[0])


def request(path: str = "/health/live", *headers: str, close: bool = False) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: test", *headers] + (["Connection: close"] if close else [])
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def sized_request(total: int, count: int) -> bytes:
    """A GET /health/live head of exactly `total` bytes with exactly `count` headers (Host and fillers)."""
    fillers = [f"X-Filler-{i}: f" for i in range(count - 2)]
    bare = request("/health/live", *fillers, "X-Pad: ")
    assert len(bare) <= total, (len(bare), total)
    return request("/health/live", *fillers, "X-Pad: " + "p" * (total - len(bare)))


def assert_rejection(response: tuple[int, dict[str, str], bytes], status: int, error_types: set[str]) -> dict:
    code, headers, body = response
    assert code == status, (code, body)
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close"
    error = json.loads(body)
    assert set(error) == {"error"} and error["error"]["type"] in error_types, error
    assert isinstance(error["error"]["message"], str) and "TSERVE_" in error["error"]["message"], error
    return error["error"]


def rejected(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {s.labels["reason"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == REJECTED}


@pytest.fixture
def conn(server):
    connections: list[Connection] = []

    def open_connection() -> Connection:
        connections.append(Connection(server.port))
        return connections[-1]

    yield open_connection
    for c in connections:
        c.close()


# --- the tests -------------------------------------------------------------------------------------------------

def test_the_rejection_series_exist_at_zero_from_the_start(server):
    assert rejected(server) == {"header_timeout": 0, "headers_too_large": 0, "too_many_headers": 0, "bad_request": 0}


def test_a_connection_that_sends_nothing_gets_408_and_is_closed(server, conn):
    c = conn()
    error = assert_rejection(c.response(HEADER_TIMEOUT_S + MARGIN_S), 408, {"header_timeout"})
    elapsed = time.monotonic() - c.opened
    assert HEADER_TIMEOUT_S - EARLY_S <= elapsed <= HEADER_TIMEOUT_S + MARGIN_S, elapsed
    assert "TSERVE_HEADER_TIMEOUT_S" in error["message"]
    assert c.closed_by_server()


def test_a_head_trickled_byte_by_byte_is_cut_at_the_header_timeout(server, conn):
    c = conn()
    head, sent = request(), 0
    while not c.readable(0.3):  # one byte every 0.3 s until the server answers
        assert sent < len(head), "the whole head was trickled without an answer"
        assert time.monotonic() - c.opened < HEADER_TIMEOUT_S + MARGIN_S, "no answer in time"
        if c.send(head[sent:sent + 1]):
            sent += 1
    assert_rejection(c.response(MARGIN_S), 408, {"header_timeout"})
    elapsed = time.monotonic() - c.opened
    assert HEADER_TIMEOUT_S - EARLY_S <= elapsed <= HEADER_TIMEOUT_S + MARGIN_S, elapsed
    assert 0 < sent < len(head)
    assert c.closed_by_server()


def test_a_huge_header_is_stopped_while_it_streams_in(server, conn):
    # a head that never ends: only the bytes received can decide, and they do before the header timeout
    c = conn()
    assert c.send(b"GET /health/live HTTP/1.1\r\nHost: test\r\nX-Huge: " + b"h" * (4 * MAX_HEADER_BYTES))
    error = assert_rejection(c.response(HEADER_TIMEOUT_S + MARGIN_S), 431, {"headers_too_large"})
    assert "TSERVE_MAX_HEADER_BYTES" in error["message"]
    assert c.closed_by_server()


def test_a_1mb_header_gets_431_before_it_is_sent(server, conn):
    c = conn()
    c.sock.settimeout(30)
    head = b"GET /health/live HTTP/1.1\r\nHost: test\r\nX-Huge: "
    huge, chunk, sent = 2**20, 16 * 1024, 0
    started = time.monotonic()
    c.send(head)
    while sent < huge and not c.readable(0.05):  # stream the MB, watching for an early answer
        assert c.send(b"h" * chunk), "closed before an answer"
        sent += chunk
    answered_after = sent
    c.send(b"h" * (huge - sent) + b"\r\n\r\n")  # the rest: discarded by the server, or refused
    assert_rejection(c.response(MARGIN_S), 431, {"headers_too_large"})
    elapsed = time.monotonic() - started
    print(f"1 MB header: 431 after {answered_after} bytes sent, {elapsed:.3f} s")
    assert answered_after < huge // 2, answered_after
    assert c.closed_by_server()


def test_5000_headers_get_431(server, conn):
    c = conn()
    c.send(request("/health/live", *(f"X-H{i}: v" for i in range(5000))))
    assert_rejection(c.response(MARGIN_S), 431, {"too_many_headers", "headers_too_large"})
    assert c.closed_by_server()


def test_one_header_over_the_count_gets_431(server, conn):
    c = conn()
    c.send(sized_request(1000, MAX_HEADER_COUNT + 1))
    error = assert_rejection(c.response(MARGIN_S), 431, {"too_many_headers"})
    assert "TSERVE_MAX_HEADER_COUNT" in error["message"]
    assert c.closed_by_server()


def test_one_byte_over_the_size_in_one_write_gets_431(server, conn):
    c = conn()
    c.send(sized_request(MAX_HEADER_BYTES + 1, 3))
    assert_rejection(c.response(MARGIN_S), 431, {"headers_too_large"})
    assert c.closed_by_server()


@pytest.mark.parametrize("split", [None, MAX_HEADER_BYTES - 2], ids=["one-write", "two-writes"])
def test_a_head_exactly_at_the_limits_is_served(server, conn, split):
    head = sized_request(MAX_HEADER_BYTES, MAX_HEADER_COUNT)
    assert len(head) == MAX_HEADER_BYTES and head.count(b"\r\n") == MAX_HEADER_COUNT + 2
    c = conn()
    if split is None:
        c.send(head)
    else:  # the incomplete head is counted as it arrives: at the limit, still allowed
        c.send(head[:split])
        time.sleep(0.2)  # let the server read the first part on its own
        c.send(head[split:])
    code, _, body = c.response(MARGIN_S)
    assert code == 200 and json.loads(body) == {"status": "live"}


def test_keep_alive_requests_with_pauses_are_served(server, conn):
    c = conn()
    for pause in (0.5, 2 * HEADER_TIMEOUT_S):  # idle between requests: uvicorn's keep-alive (5 s), not the head
        c.send(request())
        assert c.response(MARGIN_S)[0] == 200
        time.sleep(pause)
    c.send(request(close=True))
    assert c.response(MARGIN_S)[0] == 200
    assert c.closed_by_server()


def test_a_slow_second_head_on_a_keep_alive_connection_gets_408(server, conn):
    c = conn()
    c.send(request())
    assert c.response(MARGIN_S)[0] == 200
    c.send(b"GET /health/live HTTP/1.1\r\n")  # the next request's first bytes, and then nothing
    started = time.monotonic()
    assert_rejection(c.response(HEADER_TIMEOUT_S + MARGIN_S), 408, {"header_timeout"})
    elapsed = time.monotonic() - started
    assert HEADER_TIMEOUT_S - EARLY_S <= elapsed <= HEADER_TIMEOUT_S + MARGIN_S, elapsed
    assert c.closed_by_server()


def test_each_rejection_is_counted_logged_and_the_server_stays_ready(server, conn):
    before = rejected(server)
    for data in (b"", request("/health/live", *(f"X-H{i}: v" for i in range(MAX_HEADER_COUNT + 1))),
                 b"GET / HTTP/1.1\r\nX-Huge: " + b"h" * 2 * MAX_HEADER_BYTES):
        c = conn()
        c.send(data)
        c.response(HEADER_TIMEOUT_S + MARGIN_S)
    counted = ("header_timeout", "too_many_headers", "headers_too_large")
    expected = {**before, **{reason: before[reason] + 1 for reason in counted}}
    poll(lambda: rejected(server) == expected, MARGIN_S, message=f"counters {expected}")
    warnings = [r for r in server.log_records() if r.get("logger") == "tserve.http"]
    assert {r["reason"] for r in warnings} >= set(counted), warnings
    assert all(r["level"] == "warning" and r["peer"].startswith("127.0.0.1:") for r in warnings), warnings
    assert httpx.get(f"{server.url}/health/ready", timeout=30).status_code == 200


def test_many_slow_connections_at_once_are_all_cut(server, conn):
    connections = [conn() for _ in range(50)]
    threads = [threading.Thread(target=c.send, args=(b"GET / HTTP/1.1\r\nHost: te",)) for c in connections[::2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in connections:
        assert_rejection(c.response(HEADER_TIMEOUT_S + MARGIN_S), 408, {"header_timeout"})
    assert httpx.get(f"{server.url}/health/live", timeout=30).status_code == 200


def test_a_pipelined_head_that_times_out_during_a_response_gets_no_response_written_into_it():
    """In process, with a slow ASGI app: the late head of a pipelined request is counted as rejected, and the
    response in progress completes untouched (`connection: close`), with no 408 after it."""

    async def slow_app(scope, receive, send):
        if scope["type"] != "http":
            return
        await asyncio.sleep(2 * HEADER_TIMEOUT_S)  # the pipelined head times out meanwhile
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]})
        await send({"type": "http.response.body", "body": b"slow"})

    reasons: list[str] = []
    with limited_server(slow_app, reasons) as port:
        c = Connection(port)
        c.send(request("/slow") + b"GET /next HTTP/1.1\r\nHo")
        code, headers, body = c.response(2 * HEADER_TIMEOUT_S + MARGIN_S)
        assert (code, body, headers["connection"]) == (200, b"slow", "close")
        assert c.closed_by_server() and c.buffer == b"", c.buffer
        assert reasons == ["header_timeout"]
        c.close()


@contextlib.contextmanager
def limited_server(app, reasons: list[str]):
    """`app` behind the limited HTTP protocol in a uvicorn of this process, on a free port (yielded), its rejection
    reasons appended to `reasons`."""
    settings = Settings(_env_file=None, header_timeout_s=HEADER_TIMEOUT_S, max_header_bytes=MAX_HEADER_BYTES,
                        max_header_count=MAX_HEADER_COUNT)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_config=None,
                                           http=limited_http_protocol(settings, reasons.append)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        poll(lambda: server.started, MARGIN_S, message="the in-process server")
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=MARGIN_S)


UNREADABLE = {  # a request the parser cannot read -> what its 400 names
    "a raw UTF-8 path": (b"GET /v1/mod\xc3\xa9ls HTTP/1.1\r\nHost: test\r\n\r\n", "percent-encode"),
    "a raw Latin-1 path": (b"GET /health/live\xff HTTP/1.1\r\nHost: test\r\n\r\n", "percent-encode"),
    "a bad method": (b"G\x00T / HTTP/1.1\r\nHost: test\r\n\r\n", "not a valid HTTP/1.1 request"),
    "a header name with a space": (b"GET / HTTP/1.1\r\nHo st: test\r\n\r\n", "not a valid HTTP/1.1 request"),
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_a_request_the_parser_cannot_read_gets_a_json_400_naming_why(case):
    """Issue 51: raw non-ASCII path bytes got uvicorn's plain-text "Invalid HTTP request received."; in process,
    every unreadable request gets this service's JSON error (400 `bad_request`, the parser's reason), counted as a
    rejected connection, and the connection is closed."""
    data, names = UNREADABLE[case]

    async def app(scope, receive, send):  # never reached
        raise AssertionError("an unreadable request reached the app")

    reasons: list[str] = []
    with limited_server(app, reasons) as port:
        c = Connection(port)
        c.send(data)
        code, headers, body = c.response(MARGIN_S)
        assert (code, headers["content-type"], headers["connection"]) == (400, "application/json", "close"), body
        error = json.loads(body)["error"]
        assert error["type"] == "bad_request" and names in error["message"], error
        assert c.closed_by_server()
        assert reasons == ["bad_request"]
        c.close()
