"""The prefix cache's metrics for one model version (`service.engines.prefix_cache`): the tokens each prefill looked
up and found (from its jobs' `cached_tokens`), the blocks evicted since the last prefill and the bytes held."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from service.observability.metrics import Metrics
from service.scheduling.jobs import TextJob


class PrefixCacheMetrics:
    def __init__(self, cache, metrics: Metrics, labels: dict[str, str]):
        self.cache = cache
        self.queries = metrics.prefix_cache_queries.labels(**labels)
        self.hits = metrics.prefix_cache_hits.labels(**labels)
        self.evictions = metrics.prefix_cache_evictions.labels(**labels)
        self.bytes = metrics.prefix_cache_bytes.labels(**labels)
        self._evicted = 0  # the cache's evictions already counted
        self._lock = threading.Lock()  # the decoding workers observe their prefills

    @classmethod
    def of(cls, backend, metrics: Metrics, labels: dict[str, str]) -> PrefixCacheMetrics | None:
        """For a backend that keeps a prefix cache, else None."""
        cache = getattr(backend, "prefix_cache", None)
        return None if cache is None else cls(cache, metrics, labels)

    def observe(self, jobs: Sequence[TextJob]) -> None:
        """After the prompt pass of `jobs`."""
        self.queries.inc(sum(len(job.input_ids) for job in jobs))
        self.hits.inc(sum(job.cached_tokens for job in jobs))
        with self._lock:
            evicted = self.cache.stats.evicted_blocks
            self.evictions.inc(evicted - self._evicted)
            self._evicted = evicted
            self.bytes.set(self.cache.stats.bytes)
