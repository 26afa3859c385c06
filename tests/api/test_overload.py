"""Overload: a real server with small queues, driven well past its capacity on all three endpoints at once, with
deadlines short and long, streamed and not. Only 200, 429, 503 and 504 come back; every 429 carries a Retry-After
no longer than the request's own deadline; a 504 comes at its deadline, not when the request reaches the head of
its queue; the server's memory stays bounded; and afterwards every gauge reads zero and the server is ready.
"""

from __future__ import annotations

import io
import math
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from PIL import Image

from tests.support.metrics import metric, scrape
from tests.support.server import ServerProcess
from tests.support.waiting import poll

pytestmark = pytest.mark.slow

CLIENTS = 48
DURATION_S = 8.0
TIMEOUTS_MS = (150, 600, 3_000)
KNOBS = {"max_queue_size": 4, "gpt_max_batch_rows": 4, "translation_max_batch_rows": 8, "vit_max_batch_size": 8,
         "max_new_tokens": 60}
# A 504 is answered at the deadline: how late it may be, measured by the server (access log), on 2 shared cores
# with 48 client threads in the same machine. Seen: p50 20-40 ms, max 130 ms with two CPU-bound processes beside
# it, one CI run a single 0.30 s tail. The bounds leave room for a busier machine and still tell a server that
# answers at its 1 s backstop (1.29 s late then) from one that answers at the deadline.
LATE_504_P50_S, LATE_504_P95_S, LATE_504_MAX_S = 0.1, 0.5, 1.0
RSS_GROWTH_LIMIT = 300 * 2**20  # measured: see docs/operations.md


def _proc_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key + ":"))


def _image() -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (28, 28), 90).save(buffer, "PNG")
    return buffer.getvalue()


def test_overload_answers_only_200_429_503_504_with_honest_retry_after(tiny_repository, tmp_path):
    server = ServerProcess("overload server", tiny_repository, tmp_path, **KNOBS).start()
    try:
        pid = server.proc.pid
        with httpx.Client(base_url=server.url, timeout=30) as warm:
            assert warm.post("/v1/generate", json={"prompt": "A", "max_new_tokens": 2}).status_code == 200
        rss_before = _proc_kib(pid, "VmRSS") * 1024
        with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # VmHWM := VmRSS: the peak below is the overload's
        image = _image()
        outcomes: list[tuple[str, int, int, dict]] = []  # (endpoint, timeout_ms, status, headers)
        lock = threading.Lock()
        stop_at = time.monotonic() + DURATION_S

        def client(seed: int) -> None:
            rng = random.Random(seed)
            with httpx.Client(base_url=server.url, timeout=30) as c:
                while time.monotonic() < stop_at:
                    timeout_ms = rng.choice(TIMEOUTS_MS)
                    c.headers["x-request-id"] = f"t{timeout_ms}-{seed}-{rng.getrandbits(32)}"  # for the access log
                    kind = rng.choice(["generate", "stream", "translate", "classify"])
                    if kind == "classify":
                        response = c.post("/v1/classify", files=[("files", ("a.png", image))] * rng.randint(1, 4),
                                          data={"timeout_ms": str(timeout_ms)})
                    elif kind == "translate":
                        response = c.post("/v1/translate", json={
                            "text": ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen."][: rng.randint(1, 2)],
                            "num_beams": rng.choice([1, 4]), "max_new_tokens": 40, "min_new_tokens": 40,
                            "timeout_ms": timeout_ms})
                    else:
                        body = {"prompt": "ROMEO:\n", "max_new_tokens": 56, "min_new_tokens": 56,
                                "temperature": 0, "timeout_ms": timeout_ms, "stream": kind == "stream"}
                        with c.stream("POST", "/v1/generate", json=body) as response:
                            response.read()
                    with lock:
                        outcomes.append((kind, timeout_ms, response.status_code, dict(response.headers)))

        with ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(client, range(CLIENTS)))
        peak = _proc_kib(pid, "VmHWM") * 1024

        statuses = [status for _, _, status, _ in outcomes]
        counts = {s: statuses.count(s) for s in sorted(set(statuses))}
        print(f"{len(outcomes)} requests: {counts}; RSS before {rss_before / 2**20:.0f} MiB, "
              f"peak {peak / 2**20:.0f} MiB")
        assert set(counts) <= {200, 429, 503, 504}, counts
        assert counts.get(200) and counts.get(429), counts  # it served, and it was overloaded
        for _, timeout_ms, status, headers in outcomes:
            if status == 429:
                retry_after = headers.get("retry-after", "")
                assert retry_after.isdigit() and 1 <= int(retry_after) <= max(1, math.floor(timeout_ms / 1000)), \
                    (retry_after, timeout_ms)
        assert peak - rss_before <= RSS_GROWTH_LIMIT, (peak, rss_before)

        # a 504 comes at the deadline (server-side latency from the access log, minus the request's timeout)
        late = sorted((record["latency_ms"] - int(record["request_id"][1:].split("-")[0])) / 1000
                      for record in server.access_records()
                      if record["status"] == 504 and record["request_id"].startswith("t"))
        if late:
            print(f"504s: {len(late)}, lateness p50 {late[len(late) // 2] * 1000:.0f} ms, "
                  f"max {late[-1] * 1000:.0f} ms")
            assert late[len(late) // 2] <= LATE_504_P50_S, late[-10:]
            assert late[int(0.95 * (len(late) - 1))] <= LATE_504_P95_S and late[-1] <= LATE_504_MAX_S, late[-10:]

        with httpx.Client(base_url=server.url, timeout=30) as c:
            def idle():
                samples = scrape(c)
                values = [metric(samples, name, model=model) for model in ("gpt", "translation", "vit")
                          for name in ("tserve_queue_depth", "tserve_running_requests", "tserve_batch_rows")]
                return samples if not any(values) else None

            poll(idle, timeout=10, message="every queue, running and row gauge back to 0")
            assert c.get("/health/ready").status_code == 200
            assert c.post("/v1/generate", json={"prompt": "A", "max_new_tokens": 4}).status_code == 200
    finally:
        server.stop()
