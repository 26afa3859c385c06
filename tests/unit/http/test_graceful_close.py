"""Closing a connection without destroying an answer (service.http.limits), against real server processes:

- a body over the limit gets its 413, read by the client, even while the client is still sending: the server
  half-closes and discards the rest (lingering close) instead of closing into the upload, which sends a TCP reset;
- at shutdown (any `TSERVE_DRAIN_DELAY_S`, 0 included) a request sent on an idle keep-alive connection gets a
  response (503 while draining) or an explicit connection refusal for a new connection, never a reset or a close
  without a response.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.support.server import ServerProcess
from tests.support.waiting import poll

pytestmark = pytest.mark.slow

MAX_BODY_BYTES = 1_000_000
UPLOAD_BYTES = 48 * 2**20  # far more than the socket buffers hold: the server answers while the client sends
UPLOAD_CHUNK = 64 * 2**10
KEEP_ALIVE_CLIENTS = 8
REQUESTS_BEFORE_SIGTERM = 5  # per client, so every connection is established and reused


@pytest.fixture(scope="module")
def small_body_server(server_factory):
    with server_factory("body limit server", models='["gpt"]', max_body_bytes=MAX_BODY_BYTES) as process:
        yield process


def _chunks():
    sent = 0
    while sent < UPLOAD_BYTES:
        sent += UPLOAD_CHUNK
        yield b"x" * UPLOAD_CHUNK


def _upload(port: int, framing: str) -> bytes:
    """Send a whole over-limit POST as a simple client does (every byte, then read the answer, as curl or
    http.client do: only httpx tries to read after a failed write); returns what the server answered."""
    head = (f"POST /v1/generate HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            + ("transfer-encoding: chunked\r\n" if framing == "chunked" else f"content-length: {UPLOAD_BYTES}\r\n")
            + "\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head)
        for chunk in _chunks():
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk) if framing == "chunked" else chunk)
        if framing == "chunked":
            sock.sendall(b"0\r\n\r\n")
        answer = b""
        while data := sock.recv(65536):
            answer += data
    return answer


@pytest.mark.parametrize("framing", ["chunked", "content-length"])
def test_a_body_over_the_limit_gets_its_413_while_the_client_still_sends(small_body_server, framing):
    answer = _upload(small_body_server.port, framing)  # a reset here: ConnectionResetError / BrokenPipeError
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), answer[:300]
    error = json.loads(body)["error"]
    assert error["type"] == "payload_too_large" and "TSERVE_MAX_BODY_BYTES" in error["message"]
    with httpx.Client(base_url=small_body_server.url, timeout=30) as client:  # and the server is still serving
        assert client.post("/v1/generate", json={"prompt": "A", "max_new_tokens": 1}).status_code == 200


@pytest.mark.parametrize("drain_delay_s", [0, 0.5])
def test_shutdown_answers_every_request_on_idle_keep_alive_connections(tiny_repository, tmp_path, drain_delay_s):
    server = ServerProcess("keep-alive shutdown", tiny_repository, tmp_path, models='["gpt"]',
                           drain_delay_s=drain_delay_s).start()
    outcomes: list[str] = []
    lock = threading.Lock()
    warmed = threading.Barrier(KEEP_ALIVE_CLIENTS + 1)
    stop = threading.Event()

    def client() -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:  # one keep-alive connection, reused
            for i in range(REQUESTS_BEFORE_SIGTERM):
                assert c.post("/v1/generate", json={"prompt": "A", "max_new_tokens": 1}).status_code == 200
            warmed.wait()
            while not stop.is_set():
                try:
                    outcome = str(c.post("/v1/generate", json={"prompt": "A", "max_new_tokens": 1}).status_code)
                except httpx.ConnectError:
                    outcome = "refused"  # a new connection after the listener closed: the client knows at once
                except httpx.HTTPError as error:  # a reset, or a close with no response: the request is lost
                    outcome = f"lost: {type(error).__name__}: {error}"
                with lock:
                    outcomes.append(outcome)
                if outcome == "refused":
                    return

    threads = [threading.Thread(target=client) for _ in range(KEEP_ALIVE_CLIENTS)]
    try:
        for thread in threads:
            thread.start()
        warmed.wait(timeout=60)
        time.sleep(0.2)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        stop.set()
        server.stop()
    lost = [o for o in outcomes if o.startswith("lost")]
    counts = {o: outcomes.count(o) for o in set(outcomes) if not o.startswith("lost")}
    assert not lost, (len(lost), lost[:3], counts)
    assert set(counts) <= {"200", "503", "refused"}, counts
    assert counts.get("refused") == KEEP_ALIVE_CLIENTS, counts  # every client ran until the listener was gone
