"""The KV cache of a batch of decoding rows: keys/values per layer, the slot mask and each row's next position.

After text-generation-inference's `Batch` (`filter`, `concatenate`) and gpt-fast's small cache module: a tiny API
that the engines and the batching scheduler share.
- `feeds()` the past tensors of the graph; `append(presents)` adopts the graph's present tensors (one slot more);
- `select(rows)` keeps/reorders rows: beam reordering and dropping finished requests are the same operation;
- `concatenate(caches)` merges batches of different lengths by left-padding the shorter ones with masked slots,
  which is how a request joins a running batch at a step boundary.

Layout: keys[i], values[i] float32 (rows, heads, length, head_dim); mask int64 (rows, length), 1 where a slot
holds a real token; positions int64 (rows,), the position id of each row's next token. Slots are shared by all
rows (length is common), so a row's own tokens may start after some masked slots. For encoder-decoder models,
encoder_row int64 (rows,) says which encoded source each row attends to; it moves with its row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from service.onnx_schema import past_names


@dataclass
class KVCache:
    keys: list[np.ndarray]
    values: list[np.ndarray]
    mask: np.ndarray
    positions: np.ndarray
    encoder_row: np.ndarray | None = None

    @classmethod
    def empty(cls, rows: int, n_layers: int, n_heads: int, head_dim: int) -> KVCache:
        """A cache with zero slots, as the first (prefill) call of a graph wants it."""
        shape = (rows, n_heads, 0, head_dim)
        return cls([np.zeros(shape, np.float32) for _ in range(n_layers)],
                   [np.zeros(shape, np.float32) for _ in range(n_layers)],
                   np.zeros((rows, 0), np.int64), np.zeros(rows, np.int64))

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        return self.mask.shape[1]

    def feeds(self) -> dict[str, np.ndarray]:
        feeds = {}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            key_name, value_name = past_names(i)
            feeds[key_name], feeds[value_name] = k, v
        return feeds

    def append(self, presents: Sequence[np.ndarray], new_mask: np.ndarray, new_positions: np.ndarray) -> None:
        """Adopt the graph's present K/V (flat: layer 0 key, layer 0 value, ...), which hold the past plus the
        new slots; `new_mask` (rows, new) marks the new slots, `new_positions` (rows,) the next positions."""
        self.keys, self.values = list(presents[0::2]), list(presents[1::2])
        self.mask = np.concatenate([self.mask, new_mask.astype(np.int64)], axis=1)
        self.positions = new_positions.astype(np.int64)

    def select(self, rows: np.ndarray) -> None:
        """Keep rows `rows` (indices into the current rows, repeats allowed) in that order.

        A same-size reordering (beams swapping parents) copies only the rows that change, in place; anything else
        gathers the kept rows once, dropping leading slots that none of them uses any more."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == self.rows:
            moved = np.flatnonzero(rows != np.arange(self.rows))
            if moved.size == 0:
                return  # nothing moves: greedy and sampling rows keep their place
            if 2 * moved.size <= self.rows:
                sources = rows[moved]
                for array in (*self.keys, *self.values, self.mask, self.positions):
                    array[moved] = array[sources]  # the right side is gathered first, so overlaps are safe
                if self.encoder_row is not None:
                    self.encoder_row[moved] = self.encoder_row[sources]
                return
        merged = KVCache.concatenate([self], rows=[rows])
        self.keys, self.values, self.mask, self.positions = merged.keys, merged.values, merged.mask, merged.positions
        if self.encoder_row is not None:
            self.encoder_row = merged.encoder_row

    def recycle(self, rows: np.ndarray) -> None:
        """Rows whose content no longer matters (a batch's dead rows, fed padding until the next compaction):
        position 0, so that they never run past the positional table however long they are fed."""
        self.positions[rows] = 0

    def first_used_slot(self, rows: np.ndarray | None = None) -> int:
        """The first slot any of `rows` (default: all) uses; slots before it are left padding."""
        mask = self.mask if rows is None else self.mask[rows]
        used = mask.any(axis=0)
        return int(np.argmax(used)) if used.any() else self.length

    @staticmethod
    def concatenate(caches: Sequence[KVCache], encoder_offsets: Sequence[int] | None = None,
                    rows: Sequence[np.ndarray | None] | None = None) -> KVCache:
        """Stack (selected) rows of several caches in one copy; shorter caches are left-padded with masked slots
        and slots that no kept row uses are dropped.

        `rows[i]`: the rows of cache i to keep, in order (None = all). With `encoder_offsets`, cache i's encoder
        rows are shifted by offsets[i] (its sources' first row in the concatenated encoder output)."""
        rows = [np.arange(c.rows) if r is None else np.asarray(r, dtype=np.int64)
                for c, r in zip(caches, rows or [None] * len(caches))]
        firsts = [c.first_used_slot(r) if len(r) else c.length for c, r in zip(caches, rows)]
        length = max((c.length - f for c, f, r in zip(caches, firsts, rows) if len(r)), default=0)
        total = sum(len(r) for r in rows)
        reference = caches[0]
        n_heads, head_dim = reference.keys[0].shape[1], reference.keys[0].shape[3]

        def gather(arrays_of: str, layer: int | None = None) -> np.ndarray:
            if layer is None:  # the mask
                out = np.zeros((total, length), np.int64)
            else:
                out = np.zeros((total, n_heads, length, head_dim), np.float32)
            start = 0
            for cache, kept, first in zip(caches, rows, firsts):
                if len(kept) and (kept.min() < 0 or kept.max() >= cache.rows):
                    raise IndexError(f"row index out of range for a cache of {cache.rows} rows")
                if len(kept):
                    source = getattr(cache, arrays_of)
                    source = source[layer][:, :, first:] if layer is not None else source[:, first:]
                    width = source.shape[-2] if layer is not None else source.shape[-1]
                    target = (out[start : start + len(kept), :, length - width :] if layer is not None
                              else out[start : start + len(kept), length - width :])
                    np.take(source, kept, axis=0, out=target, mode="clip")
                start += len(kept)
            return out

        n_layers = len(reference.keys)
        encoder_row = None
        if encoder_offsets is not None or reference.encoder_row is not None:
            offsets = encoder_offsets or [0] * len(caches)
            encoder_row = np.concatenate([c.encoder_row[r] + o for c, r, o in zip(caches, rows, offsets)])
        return KVCache(
            [gather("keys", i) for i in range(n_layers)],
            [gather("values", i) for i in range(n_layers)],
            gather("mask"),
            np.concatenate([c.positions[r] for c, r in zip(caches, rows)]),
            encoder_row,
        )
