"""HTTP load on the service from outside, for the Ray cluster's test (tests/deploy/test_ray_cluster.py) and its
latency benchmark (bench/ray_latency.py): the three capabilities (a greedy translation, a streamed generation, a
one-image classification), each request retried once where nginx would retry it, and every outcome kept with its
times so that a test can count failures per phase (scale-up, node killed, scale-down).

- `mix(png)`: the requests, in the order a client cycles through them.
- `send(client, request)`: one try; a 200 whose body is complete (a stream's last event before `[DONE]` has its
  finish_reason) or the reason it failed.
- `send_retrying(client, request)`: a second try after a failure nginx retries (deploy/nginx/nginx.conf
  `proxy_next_upstream error timeout http_502 http_503 http_429`), or after a 500 from Ray's proxy itself (not the
  service, whose errors are JSON): what Ray answers for a request whose replica died under it.
- `ClosedLoop`: client threads, each sending its next request when the last one ends; `clients(n)` changes how many
  are active (a burst and its end); bounded by `max_requests` whatever happens.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

from service.client.sse import SSEError, parse_sse

RETRIED_STATUSES = {429, 502, 503}  # nginx's proxy_next_upstream statuses
RAY_PROXY_ERROR = 500  # Ray's proxy's own 500 (plain text), not one of the service's (JSON)
REQUEST_TIMEOUT_S = 60.0
IDLE_POLL_S = 0.05  # how often an inactive client looks whether it is wanted again
NEW_TOKENS = 16  # per generated or translated text: short requests, many of them


@dataclass(frozen=True)
class Request:
    name: str
    path: str
    json: dict | None = None
    files: list | None = None
    streamed: bool = False


@dataclass
class Outcome:
    name: str
    start: float  # time.monotonic()
    end: float
    status: int  # -1: no response (a transport error)
    error: str  # "" when it succeeded
    tries: int

    @property
    def ok(self) -> bool:
        return not self.error


def mix(png: bytes) -> list[Request]:
    return [
        Request("translate", "/v1/translate",
                json={"text": "Ein Mann fährt mit dem Fahrrad.", "num_beams": 1, "max_new_tokens": NEW_TOKENS}),
        Request("generate stream", "/v1/generate",
                json={"prompt": "ROMEO:\n", "max_new_tokens": NEW_TOKENS, "temperature": 0, "stream": True},
                streamed=True),
        Request("classify", "/v1/classify", files=[("files", ("0.png", png, "image/png"))]),
    ]


def send(client: httpx.Client, request: Request) -> tuple[int, str]:
    """(status, "") when the request succeeded, else (status or -1, why)."""
    try:
        if request.streamed:
            with client.stream("POST", request.path, json=request.json) as response:
                body = response.read()
            if response.status_code != 200:
                return response.status_code, body[:300].decode(errors="replace")
            events = parse_sse(body)
            if not events or "finish_reason" not in events[-1]:
                return 200, f"a stream without its last event: {events[-1:]}"
            return 200, ""
        response = client.post(request.path, json=request.json, files=request.files)
        return response.status_code, "" if response.status_code == 200 else response.text[:300]
    except (httpx.HTTPError, SSEError) as error:  # no response, or a cut or malformed stream
        return -1, repr(error)


def retried(status: int, error: str) -> bool:
    """Whether a failure is one a proxy in front retries: no response, nginx's statuses, or Ray's proxy's own 500."""
    return status == -1 or status in RETRIED_STATUSES or (status == RAY_PROXY_ERROR and not error.startswith("{"))


def send_retrying(client: httpx.Client, request: Request, retries: int = 1) -> Outcome:
    start = time.monotonic()
    for tries in range(1, retries + 2):
        status, error = send(client, request)
        if not error or not retried(status, error):
            break
    return Outcome(request.name, start, time.monotonic(), status, error, tries)


@dataclass
class ClosedLoop:
    """`threads` client threads over `requests`, `active` of them sending (each its next request when the last ended,
    after `pause_s`); the others wait. Every outcome is kept in `outcomes`."""

    url: str
    requests: list[Request]
    threads: int
    max_requests: int
    pause_s: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self):
        self._active = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.threads)]

    def start(self, active: int) -> ClosedLoop:
        self._active = active
        for thread in self._threads:
            thread.start()
        return self

    def clients(self, active: int) -> None:
        self._active = active

    def _run(self, index: int) -> None:
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
            i = index
            while not self._stop.is_set() and len(self.outcomes) < self.max_requests:
                if index >= self._active:
                    self._stop.wait(IDLE_POLL_S)
                    continue
                outcome = send_retrying(client, self.requests[i % len(self.requests)])
                i += 1
                with self._lock:
                    self.outcomes.append(outcome)
                self._stop.wait(self.pause_s)

    def stop(self, timeout: float = REQUEST_TIMEOUT_S) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)
        assert not any(thread.is_alive() for thread in self._threads), "a client thread hung"
        return list(self.outcomes)

    def between(self, start: float, end: float) -> list[Outcome]:
        """The outcomes of the requests sent in [start, end)."""
        with self._lock:
            return [o for o in self.outcomes if start <= o.start < end]
