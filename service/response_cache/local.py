"""The response cache's local store (Triton's `local` cache): entries in this process's memory, within a bound in
bytes, the least recently used evicted first (an `OrderedDict` as the LRU list, as `functools.lru_cache` keeps one).

An entry's size is its key, its value and `ENTRY_OVERHEAD_BYTES`; one larger than `MAX_ENTRY_SHARE` of the bound is
not stored (it would evict most of the others). Thread-safe: the event loop and a batch job's loop may share it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from service.observability.metrics import Metrics

# What an entry costs besides its key and value: the dict slot, the bytes and str objects' headers (CPython's
# sys.getsizeof of an empty bytes is 33, of a str 49, a dict slot with the LRU links ~100).
ENTRY_OVERHEAD_BYTES = 200
MAX_ENTRY_SHARE = 0.25  # no one answer may take more than this share of the bound
LOCAL = "local"


class LocalStore:
    kind = LOCAL

    def __init__(self, capacity_bytes: int, metrics: Metrics):
        self.capacity = capacity_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._evictions = metrics.response_cache_evictions
        metrics.response_cache_bytes.set_function(lambda: self.bytes)
        metrics.response_cache_entries.set_function(lambda: len(self._entries))

    @staticmethod
    def size(key: str, value: bytes) -> int:
        return len(key) + len(value) + ENTRY_OVERHEAD_BYTES

    async def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    async def put(self, key: str, value: bytes) -> None:
        size = self.size(key, value)
        if size > self.capacity * MAX_ENTRY_SHARE:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= self.size(key, old)
            self._entries[key] = value
            self.bytes += size
            while self.bytes > self.capacity:
                evicted, data = self._entries.popitem(last=False)
                self.bytes -= self.size(evicted, data)
                self._evictions.inc()

    def problems(self) -> list[str]:
        return []

    async def check(self) -> None:
        """Nothing to probe: memory is always there."""

    async def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0
