"""The response cache in Redis (docs/response_cache.md), with a real redis-server the test starts on a free port and
two in-process replicas sharing it: a request answered by one is a hit on the other; the server killed while
requests flow fails none of them (served uncached), and the metrics and the readiness reasons say so while the
replicas stay ready; started again, it is found by the next readiness probe and caching resumes.

Needs `redis-server` (Debian's package; deploy/ci-packages.txt): skipped with the install hint on a developer's
machine, a failure under CI (`tests.support.deploy.require_tool`)."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from service.client.processes import free_port
from service.response_cache.redis_store import RETRY_S
from service.settings import Settings
from tests.support.deploy import require_tool, wait_for

pytestmark = pytest.mark.slow

BODY = {"text": "Ein Mann fährt mit dem Fahrrad.", "num_beams": 2}
START_S = 10.0  # the longest a redis-server may take to answer its first PING on a busy machine


class RedisServer:
    """redis-server on `port`, in memory only (no snapshot, no append-only file)."""

    def __init__(self, binary: str, port: int):
        self.binary, self.port = binary, port
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                         "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_for("redis-server answers", self._answers, START_S, self.process)

    def _answers(self) -> bool:
        import redis

        try:
            return redis.Redis(port=self.port, socket_timeout=1).ping()
        except redis.RedisError:
            return False

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def redis_server():
    server = RedisServer(require_tool("redis-server"), free_port())
    server.start()
    yield server
    server.kill()


def _sample(client, name: str, **labels) -> float:
    return client.app.state.metrics.registry.get_sample_value(name, labels) or 0.0


def _hits(client) -> float:
    return _sample(client, "tserve_response_cache_lookup_seconds_count", model="translation", version="1",
                   result="hit")


def test_replicas_share_redis_and_keep_serving_when_it_is_killed(tiny_repository, serving, redis_server):
    settings = Settings(repository=tiny_repository, models=["translation"], grpc_port=0, variant="stored",
                        calibration_cache="", response_cache="translation",
                        response_cache_redis_url=f"redis://127.0.0.1:{redis_server.port}/0")
    with serving(settings) as one, serving(settings) as two:
        first = one.post("/v1/translate", json=BODY)
        assert first.status_code == 200 and _hits(one) == 0
        assert two.post("/v1/translate", json=BODY).content == first.content and _hits(two) == 1  # the other's
        models = {m["id"]: m for m in one.get("/v1/models").json()["data"]}
        assert models["translation"]["response_cache"]["store"] == "redis"

        failures, answered, stop = [], [], threading.Event()

        def traffic() -> None:  # requests flow while the server is killed
            n = 0
            while not stop.is_set():
                response = one.post("/v1/translate", json={**BODY, "text": f"Ein Hund {n % 7}."})
                (answered if response.status_code == 200 else failures).append(response.status_code)
                n += 1

        sender = threading.Thread(target=traffic)
        sender.start()
        try:
            time.sleep(0.5)
            redis_server.kill()
            time.sleep(2 * RETRY_S)
        finally:
            stop.set()
            sender.join()
        assert not failures and len(answered) > 10
        assert one.post("/v1/translate", json=BODY).content == first.content  # computed again, the same bytes
        errors = sum(_sample(one, "tserve_response_cache_redis_errors_total", operation=op) for op in ("get", "set"))
        assert errors >= 1
        assert _sample(one, "tserve_response_cache_redis_up", server=f"127.0.0.1:{redis_server.port}/0") == 0
        ready = one.get("/health/ready")
        assert ready.status_code == 200 and ready.json()["status"] == "ready"
        (reason,) = ready.json()["reasons"]
        assert f"Redis at 127.0.0.1:{redis_server.port}/0 unreachable" in reason and "serving uncached" in reason

        redis_server.start()  # empty again
        time.sleep(RETRY_S)
        assert one.get("/health/ready").json() == {"status": "ready"}  # the probe found it
        assert _sample(one, "tserve_response_cache_redis_up", server=f"127.0.0.1:{redis_server.port}/0") == 1
        one.post("/v1/translate", json=BODY)
        hits = _hits(two)
        wait_for("replica two answers again from Redis", lambda: two.post("/v1/translate", json=BODY).content ==
                 first.content and _hits(two) > hits, 3 * RETRY_S)
