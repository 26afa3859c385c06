"""The KV cache's storage (`service.engines.kv_cache.KVCache`): its layout, and how buffers are sized and allocated.

Layout: keys[i], values[i] (rows, heads, capacity, head_dim), float32, or int8 for a quantised cache
(`service.engines.kv_quantization`; every copy keeps the cache's element type); mask int64 (rows, capacity), 1 where
a slot holds a real token; positions int64 (rows,), each row's next position id; encoder_row int64 (rows,), for
encoder-decoder models the encoded source a row attends to (it moves with its row). Two modes, after vLLM's and
gpt-fast's pre-allocated caches:
- exact (`lengths` None): capacity == length, slots shared by all rows, so a row's tokens may follow masked slots;
- buffers (`lengths` = each row's slots in use): every row's tokens in slots [0, lengths[row]), the rest zero and
  masked, written in place by a step; capacity grows with a headroom (`capacity_for`) or to a `limit` at once, and
  a `RowStorage` keeps room for more rows (`ROW_HEADROOM`) so that joins and departures need no new buffers.
Invariant: every slot no row uses, in every row of a storage, is zero (as in a fresh buffer).

Design notes: docs/architecture.md, service/engines/kv_storage.py.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

CAPACITY_STEP = 16  # buffer capacities are multiples of this many slots
# A full buffer is replaced by one with this much headroom: attention over it costs at most 1 + HEADROOM times the
# used slots, and a growth's copy about 1 / HEADROOM slots per step (measurements: the design notes).
HEADROOM = 0.25
# Buffers grown to a limit at least this large are fresh anonymous pages, zeroed by the kernel when first written.
FRESH_PAGES_BYTES = 1 << 20
# Buffers hold this much more rows than they are made for (`RowStorage`), at least ROW_STEP, so that joins write
# into them instead of copying every row into new ones; unused rows are zero pages, paid for when first written.
ROW_HEADROOM = 0.25
ROW_STEP = 4


def zeroed(shape: tuple[int, ...], dtype) -> np.ndarray:
    """`np.zeros` for a buffer grown to `KVCache.limit` at once: mostly slots never written (its attention reads the
    used slots only), so, when large, fresh anonymous pages, which the kernel zeroes when first written; `np.zeros`
    (calloc) zeroes eagerly when the heap recycles a freed chunk: gpt/4's +gqa buffers at 64 rows are 201 MB, and
    that memset made their first step 89 ms instead of 22 (bench/calibration_length.py). Buffers grown with a
    headroom are read whole by their attention, so they stay `np.zeros` (fresh pages only add faults there)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if size < FRESH_PAGES_BYTES:
        return np.zeros(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE), dtype).reshape(shape)  # unmapped when freed


def capacity_for(slots: int, limit: int | None = None) -> int:
    """The buffer capacity for `slots` used slots: `HEADROOM` more, rounded up to a multiple of CAPACITY_STEP; with
    a `limit` (`KVCache.limit`), that limit, or `slots` where they are more."""
    if limit is not None:
        return max(slots, limit)
    return max(CAPACITY_STEP, -(-int(slots * (1 + HEADROOM)) // CAPACITY_STEP) * CAPACITY_STEP)


def rows_for(rows: int) -> int:
    """The rows a buffers' storage is made with for `rows` rows: `ROW_HEADROOM` more, a multiple of ROW_STEP."""
    return max(ROW_STEP, -(-int(rows * (1 + ROW_HEADROOM)) // ROW_STEP) * ROW_STEP)


@dataclass
class RowStorage:
    """Buffers with room for more rows than a cache holds: a buffered cache's keys, values and mask are views of
    the first rows of these arrays. Every slot no row uses, in every row of the storage, is zero."""

    keys: list[np.ndarray]  # per layer (row capacity, heads, slot capacity, head_dim), the cache's element type
    values: list[np.ndarray]
    mask: np.ndarray  # (row capacity, slot capacity) int64

    @classmethod
    def allocate(cls, rows: int, n_layers: int, n_heads: int, capacity: int, head_dim: int, dtype=np.float32,
                 fresh: bool = False) -> RowStorage:
        """Zeroed storage for `rows` rows of `capacity` slots, keys and values of `dtype` (in fresh pages, `zeroed`,
        when `fresh`)."""
        allocate = zeroed if fresh else np.zeros
        shape = (rows, n_heads, capacity, head_dim)
        return cls([allocate(shape, dtype) for _ in range(n_layers)],
                   [allocate(shape, dtype) for _ in range(n_layers)], np.zeros((rows, capacity), np.int64))

    @property
    def rows(self) -> int:
        return self.mask.shape[0]


def aligned_storage(keys: list[np.ndarray], values: list[np.ndarray], mask: np.ndarray, room: int | None = None,
                    limit: int | None = None, storage_rows: int | None = None) -> tuple[RowStorage, np.ndarray]:
    """Exact storage moved into the buffer layout: each row's used slots first, in their order, zeros after;
    returns (storage, lengths): a storage of the same rows and width, or, with `room`, of the capacity that
    `KVCache.reserve(room)` grows to (`capacity_for` the longest row's slots + `room`, `limit`), the keys and values in
    fresh pages (`zeroed`) when that is the limit, and with `storage_rows` rows (the first ones hold these)."""
    used = mask.astype(bool)
    lengths = used.sum(axis=1).astype(np.int64)
    rows, width = mask.shape
    capacity = width if room is None else capacity_for(int(lengths.max(initial=0)) + room, limit)
    copied = min(width, capacity)  # slots past the longest row are masked in every row: zeros either way
    keep = np.arange(width) < lengths[:, None]  # (rows, slots) in the new layout
    # already aligned (a right-padded prompt): nothing moves; else used slots first, in their order
    order = None if (used == keep).all() else np.argsort(~used, axis=1, kind="stable")
    storage = RowStorage.allocate(storage_rows or rows, len(keys), keys[0].shape[1], capacity, keys[0].shape[3],
                                  keys[0].dtype, fresh=room is not None and limit is not None)

    def move(array: np.ndarray, out: np.ndarray) -> None:  # (rows, heads, slots, head_dim)
        source = array if order is None else np.take_along_axis(array, order[:, None, :, None], axis=2)
        # what is masked is zero, as in a fresh buffer
        np.multiply(source[:, :, :copied], keep[:, None, :copied, None].astype(array.dtype),
                    out=out[:rows, :, :copied])

    for array, out in zip((*keys, *values), (*storage.keys, *storage.values)):
        move(array, out)
    storage.mask[:rows, :copied] = keep[:, :copied]
    return storage, lengths
