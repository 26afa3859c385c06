"""The response cache in Redis (Triton's `redis` cache), shared by every replica that names the same server, so a
repeat is a hit whichever replica gets it. Redis's own `maxmemory` with `allkeys-lru` bounds it (the compose stack
sets both).

The cache must never fail or slow a request: every command is bounded by the timeout (`TSERVE_RESPONSE_CACHE_REDIS_
TIMEOUT_MS`, 50 ms; no retries), and an error or timeout marks Redis down: until `RETRY_S` has passed no request
waits on it (each is served uncached), then one request (or a readiness probe) tries again. While down the metrics
(`tserve_response_cache_redis_up` 0, `tserve_response_cache_redis_errors_total`) and the readiness reasons say so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from urllib.parse import urlsplit

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from service.observability.metrics import Metrics

log = logging.getLogger(__name__)

REDIS = "redis"
KEY_PREFIX = "tserve:response:"  # every key this service writes, so that a shared server can hold others' too
RETRY_S = 1.0  # how long Redis is left alone after an error: at most one request a second waits on a dead server


def where(url: str) -> str:
    """The server a URL names, without its credentials (`redis://:secret@cache:6379/0` -> `cache:6379/0`)."""
    parts = urlsplit(url)
    return f"{parts.hostname or 'localhost'}:{parts.port or 6379}{parts.path or ''}"


class RedisStore:
    kind = REDIS

    def __init__(self, url: str, timeout_s: float, metrics: Metrics, clock: Callable[[], float] = time.monotonic):
        self.where, self.timeout_s = where(url), timeout_s
        self._client = redis.asyncio.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                                    retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._clock = clock
        self._errors = metrics.response_cache_redis_errors
        self._up = metrics.response_cache_redis_up.labels(server=self.where)
        self._up.set(1)
        self._down_since: datetime | None = None  # wall-clock time of the first error of this outage
        self._error = ""
        self._retry_at = 0.0
        self._probing = False

    async def get(self, key: str) -> bytes | None:
        return await self._call("get", lambda: self._client.get(KEY_PREFIX + key))

    async def put(self, key: str, value: bytes) -> None:
        await self._call("set", lambda: self._client.set(KEY_PREFIX + key, value))

    async def check(self) -> None:
        """Probe a server marked down once its retry time has come (the readiness route calls this)."""
        if self._down_since is not None:
            await self._call("ping", self._client.ping)

    async def _call(self, operation: str, command: Callable[[], Awaitable]):
        """The command's result, or None without waiting while Redis is down, or None after an error (counted)."""
        probe = self._down_since is not None
        if probe and (self._probing or self._clock() < self._retry_at):
            return None
        if probe:
            self._probing = True
        try:
            result = await asyncio.wait_for(command(), self.timeout_s)
        except Exception as error:  # anything the client raises: the request goes on uncached
            self._failed(operation, error)
            return None
        else:
            if self._down_since is not None:
                log.warning("response cache: Redis at %s answers again; caching resumed", self.where)
                self._down_since, self._error = None, ""
                self._up.set(1)
            return result
        finally:
            if probe:
                self._probing = False

    def _failed(self, operation: str, error: Exception) -> None:
        self._errors.labels(operation=operation).inc()
        self._retry_at = self._clock() + RETRY_S
        self._error = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        if self._down_since is None:
            self._down_since = datetime.now(timezone.utc)
            self._up.set(0)
            log.warning("response cache: Redis at %s failed (%s); serving uncached, retrying every %g s",
                        self.where, self._error, RETRY_S)

    def problems(self) -> list[str]:
        if self._down_since is None:
            return []
        return [f"response cache: Redis at {self.where} unreachable since {self._down_since:%Y-%m-%dT%H:%M:%SZ} "
                f"({self._error}); serving uncached, retrying every {RETRY_S:g} s"]

    async def close(self) -> None:
        try:
            await self._client.aclose()
        except Exception:  # a connection already broken: nothing left to close
            log.debug("response cache: closing the Redis client", exc_info=True)
