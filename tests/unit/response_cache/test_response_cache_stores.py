"""The response cache's stores without a server: the local one keeps the least recently used entries within its bound
in bytes and counts what it evicts; the Redis one never makes a request wait past its timeout, leaves a server that
failed alone for `RETRY_S` (then probes it once), and says so in its metrics and problems. A server that accepts
connections and never answers stands for a slow Redis (no redis-server needed here; the killed one is
tests/api/test_response_cache_redis.py)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from service.observability.metrics import Metrics
from service.response_cache.local import ENTRY_OVERHEAD_BYTES, LocalStore
from service.response_cache.redis_store import RETRY_S, RedisStore, where

ENTRY = 1000  # bytes of each value below
TIMEOUT_S = 0.05


def _value(n: int) -> bytes:
    return bytes([n % 256]) * ENTRY


def test_the_local_store_evicts_the_least_recently_used_within_its_bound():
    metrics = Metrics()
    size = LocalStore.size("k00", _value(0))
    assert size == 3 + ENTRY + ENTRY_OVERHEAD_BYTES
    store = LocalStore(capacity_bytes=5 * size, metrics=metrics)

    async def run():
        for n in range(5):
            await store.put(f"k{n:02d}", _value(n))
        assert await store.get("k00") == _value(0)  # k00 is now the most recently used: k01 goes first
        await store.put("k05", _value(5))
        assert await store.get("k01") is None and await store.get("k00") == _value(0)
        assert store.bytes == 5 * size <= store.capacity
        await store.put("k05", _value(6))  # replaced, not counted twice
        assert store.bytes == 5 * size and await store.get("k05") == _value(6)
        for n in range(6, 40):
            await store.put(f"k{n:02d}", _value(n))
        assert store.bytes <= store.capacity and all([await store.get(f"k{n:02d}") is not None for n in range(35, 40)])
        await store.put("huge", b"x" * store.capacity)  # over a quarter of the bound: not stored, nothing evicted
        assert await store.get("huge") is None and await store.get("k39") == _value(39)

    asyncio.run(run())
    r = metrics.registry
    assert r.get_sample_value("tserve_response_cache_bytes") == store.bytes
    assert r.get_sample_value("tserve_response_cache_entries") == 5
    assert r.get_sample_value("tserve_response_cache_evictions_total") == 1 + 34


def test_an_entry_of_exactly_the_largest_share_is_stored_and_close_empties_the_store():
    metrics = Metrics()
    store = LocalStore(capacity_bytes=4 * LocalStore.size("k", _value(0)), metrics=metrics)

    async def run():
        await store.put("k", _value(0))  # exactly a quarter of the bound: stored
        assert await store.get("k") == _value(0) and store.bytes == store.capacity // 4
        await store.close()
        assert store.bytes == 0 and await store.get("k") is None

    asyncio.run(run())


@pytest.fixture
def silent_server():
    """A TCP port that accepts connections (the kernel's backlog) and never answers: a Redis that hangs."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    server.close()


def test_a_redis_that_hangs_costs_a_request_the_timeout_at_most_and_is_then_left_alone(silent_server):
    metrics = Metrics()
    now = [0.0]
    store = RedisStore(silent_server, TIMEOUT_S, metrics, clock=lambda: now[0])

    async def run():
        started = time.perf_counter()
        assert await store.get("a") is None  # the timeout, then a miss
        first = time.perf_counter() - started
        assert first < 10 * TIMEOUT_S
        started = time.perf_counter()
        results = await asyncio.gather(*(store.get("a") for _ in range(20)), store.put("a", b"v"))
        assert results == [None] * 21 and time.perf_counter() - started < TIMEOUT_S  # down: nobody waits
        (problem,) = store.problems()
        assert problem.startswith(f"response cache: Redis at {where(silent_server)} unreachable since ")
        assert "serving uncached" in problem
        now[0] += RETRY_S  # time to try again: one probe, which times out again
        started = time.perf_counter()
        assert await store.get("a") is None and time.perf_counter() - started >= TIMEOUT_S * 0.9
        await store.close()

    asyncio.run(run())
    r = metrics.registry
    assert r.get_sample_value("tserve_response_cache_redis_errors_total", {"operation": "get"}) == 2
    assert r.get_sample_value("tserve_response_cache_redis_up", {"server": where(silent_server)}) == 0


def test_a_redis_url_is_reported_without_its_credentials():
    assert where("redis://:s3cret@cache.internal:6380/2") == "cache.internal:6380/2"
    assert where("redis://user:pw@localhost") == "localhost:6379"
