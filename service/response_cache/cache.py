"""The response cache of one server (docs/response_cache.md; Triton's response cache): its store (local, or Redis
when `TSERVE_RESPONSE_CACHE_REDIS_URL` names one), which models it is on for, and per loaded version a
`VersionCache`: on or off and why, the scope its keys start from, and its metrics (lookups timed by result, the
requests that cannot be cached). The serving layer (`service.serving.cached`) is its one user.

Off by default, as Triton's: on for the models `TSERVE_RESPONSE_CACHE` names (or `all`) and for a version whose
config.json says `"response_cache": {"enable": true}`; `none` turns it off for every model, configs included.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from service.observability.metrics import Metrics
from service.response_cache.codec import Undecodable, decode, encode
from service.response_cache.keys import request_key, version_scope
from service.response_cache.local import LocalStore
from service.response_cache.redis_store import RedisStore

log = logging.getLogger(__name__)

ALL, NONE = "all", "none"  # TSERVE_RESPONSE_CACHE's words besides model names
BY_SETTING, BY_CONFIG = "TSERVE_RESPONSE_CACHE", "config.json"  # what turned it on for a version
HIT, MISS = "hit", "miss"  # the lookups' `result` label
MIB = 2**20
MS_PER_S = 1000


def enabled_by(models: Sequence[str], name: str, config: Mapping[str, Any]) -> str | None:
    """What turns the cache on for model `name` (whose version's config.json is `config`), or None: it is off."""
    if NONE in models:
        return None
    if ALL in models or name in models:
        return BY_SETTING
    section = config.get("response_cache")
    return BY_CONFIG if isinstance(section, Mapping) and section.get("enable") is True else None


class ResponseCache:
    def __init__(self, settings, metrics: Metrics):
        self.models = list(settings.response_cache)
        self.metrics = metrics
        self.store: LocalStore | RedisStore
        if settings.response_cache_redis_url:
            self.store = RedisStore(settings.response_cache_redis_url,
                                    settings.response_cache_redis_timeout_ms / MS_PER_S, metrics)
        else:
            self.store = LocalStore(settings.response_cache_mb * MIB, metrics)

    def for_version(self, name: str, version: int, kind: str, provider: str, variant: Mapping[str, Any],
                    config: Mapping[str, Any]) -> VersionCache:
        """The cache as one loaded version sees it."""
        return VersionCache(self, name, version, enabled_by(self.models, name, config),
                            version_scope(name, version, kind, provider, variant, config))

    def problems(self) -> list[str]:
        """What the readiness route reports while the server serves without its cache (Redis down)."""
        return self.store.problems()

    async def check(self) -> None:
        await self.store.check()

    async def close(self) -> None:
        await self.store.close()


class VersionCache:
    def __init__(self, cache: ResponseCache, name: str, version: int, enabled_by: str | None, scope: str):
        self.cache, self.enabled_by, self.scope = cache, enabled_by, scope
        labels = {"model": name, "version": str(version)}
        self._hits = cache.metrics.response_cache_lookup_seconds.labels(**labels, result=HIT)
        self._misses = cache.metrics.response_cache_lookup_seconds.labels(**labels, result=MISS)
        self._uncacheable = cache.metrics.response_cache_uncacheable.labels(**labels)

    @property
    def enabled(self) -> bool:
        return self.enabled_by is not None

    def report(self) -> dict[str, Any]:
        """What /v1/models says of it."""
        return {"enabled": self.enabled, "enabled_by": self.enabled_by, "store": self.cache.store.kind}

    def key(self, capability: str, fields: Mapping[str, Any], blobs: Sequence[bytes] = ()) -> str:
        return request_key(self.scope, capability, fields, blobs)

    async def lookup(self, key: str, types: Iterable[type]) -> Any | None:
        """The answer cached under `key`, rebuilt from the classes `types`, or None (a miss); timed either way."""
        started = time.perf_counter()
        data = await self.cache.store.get(key)
        value = None
        if data is not None:
            try:
                value = decode(data, types)
            except Undecodable as error:  # another format's or a damaged entry: computed again and overwritten
                log.warning("response cache: entry %s does not decode (%s); computing it again", key[:16], error)
        (self._misses if value is None else self._hits).observe(time.perf_counter() - started)
        return value

    async def save(self, key: str, value: Any) -> None:
        """Store `value` under `key`; a value that cannot be encoded is logged and not stored (never an error)."""
        try:
            data = encode(value)
        except TypeError as error:
            log.warning("response cache: an answer not stored (%s)", error)
            return
        await self.cache.store.put(key, data)

    def uncacheable(self) -> None:
        """Count a request whose answer is not a function of its key (unseeded sampling)."""
        self._uncacheable.inc()
