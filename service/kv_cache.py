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
        """Keep rows `rows` (indices into the current rows, repeats allowed) in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == self.rows and np.array_equal(rows, np.arange(self.rows)):
            return  # nothing moves: greedy and sampling rows keep their place
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.mask = self.mask[rows]
        self.positions = self.positions[rows]
        if self.encoder_row is not None:
            self.encoder_row = self.encoder_row[rows]
        self.trim()

    def trim(self) -> None:
        """Drop leading slots that no row uses any more (left padding left behind by departed rows)."""
        if self.rows == 0 or self.length == 0:
            return
        used = self.mask.any(axis=0)
        first = int(np.argmax(used)) if used.any() else self.length
        if first > 0:
            self.keys = [np.ascontiguousarray(k[:, :, first:]) for k in self.keys]
            self.values = [np.ascontiguousarray(v[:, :, first:]) for v in self.values]
            self.mask = self.mask[:, first:]

    @staticmethod
    def concatenate(caches: Sequence[KVCache], encoder_offsets: Sequence[int] | None = None) -> KVCache:
        """Stack the rows of several caches; shorter caches are left-padded with masked (zero) slots.

        With `encoder_offsets`, cache i's encoder rows are shifted by offsets[i] (its sources' first row in the
        concatenated encoder output)."""
        length = max(c.length for c in caches)

        def left_pad(array: np.ndarray, axis: int) -> np.ndarray:
            missing = length - array.shape[axis]
            if missing == 0:
                return array
            widths = [(0, 0)] * array.ndim
            widths[axis] = (missing, 0)
            return np.pad(array, widths)

        n_layers = len(caches[0].keys)
        return KVCache(
            [np.concatenate([left_pad(c.keys[i], 2) for c in caches]) for i in range(n_layers)],
            [np.concatenate([left_pad(c.values[i], 2) for c in caches]) for i in range(n_layers)],
            np.concatenate([left_pad(c.mask, 1) for c in caches]),
            np.concatenate([c.positions for c in caches]),
            None if encoder_offsets is None else
            np.concatenate([c.encoder_row + offset for c, offset in zip(caches, encoder_offsets)]),
        )
