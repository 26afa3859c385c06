"""The KV cache of a batch of decoding rows: keys/values per layer, the slot mask and each row's next position.

After text-generation-inference's `Batch` (`filter`, `concatenate`) and gpt-fast's small cache module: a tiny API
that the engines and the batching scheduler share. `feeds()` / `append(presents)` step exact storage (the graph's
presents adopted); `open_slot()` / `advance()` step buffers written in place (`export.kv_inplace`'s graph, bound by
`service.engines.iobinding.InPlaceStep`); `select(rows)` keeps/reorders rows (beam reordering and dropping finished
requests are the same operation); `concatenate(caches)` is how requests join a running batch at a step boundary
(`in_place=True`: into its own buffers while they have room). Storage layout: `service.engines.kv_storage`.

Invariant: buffers keep every row where it would be alone (slot 0 onwards), whatever the batch; joins, reorders
and growth only ever add slots after a row's. This makes a row's logits bit-identical alone and in any batch
(ONNX Runtime's attention reductions group a row's slots by their offset in the row).

Design notes: docs/architecture.md, service/engines/kv_cache.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from service.engines.kv_storage import HEADROOM, RowStorage, aligned_storage, capacity_for, rows_for
from service.engines.onnx_schema import past_names

# A same-size reorder that moves at most this fraction of the rows (beams swapping a few parents) copies just those
# rows in place; one that moves more gathers every row into a fresh cache in one pass instead.
IN_PLACE_REORDER_FRACTION = 0.5


@dataclass
class KVCache:
    keys: list[np.ndarray]
    values: list[np.ndarray]
    mask: np.ndarray
    positions: np.ndarray
    encoder_row: np.ndarray | None = None
    lengths: np.ndarray | None = None  # (rows,) int64 slots in use per row in capacity buffers; None: exact storage
    # the IO binding `service.engines.iobinding.InPlaceStep` made for these buffers (a `StepBinding`), if any
    step_binding: object | None = field(default=None, repr=False, compare=False)
    # buffers: the capacity they grow to at once when full (e.g. the context length), instead of `HEADROOM` over
    # the used slots; for a step whose attention reads each row's used slots only (GroupQueryAttention), where room
    # costs memory, not time: one growth instead of several, each a fresh allocation and a copy of the cache
    limit: int | None = None
    # buffers: the storage whose first rows `keys`, `values` and `mask` are (None: they are whole arrays)
    storage: RowStorage | None = field(default=None, repr=False, compare=False)

    @classmethod
    def empty(cls, rows: int, n_layers: int, n_heads: int, head_dim: int, limit: int | None = None) -> KVCache:
        """A cache with zero slots, as the first (prefill) call of a graph wants it (`limit`: see the field)."""
        shape = (rows, n_heads, 0, head_dim)
        return cls([np.zeros(shape, np.float32) for _ in range(n_layers)],
                   [np.zeros(shape, np.float32) for _ in range(n_layers)],
                   np.zeros((rows, 0), np.int64), np.zeros(rows, np.int64), limit=limit)

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def length(self) -> int:
        """Slots in use (buffers: by the longest row)."""
        return self.mask.shape[1] if self.lengths is None else int(self.lengths.max(initial=0))

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]

    @property
    def buffered(self) -> bool:
        return self.lengths is not None

    def reserve(self, slots: int) -> None:
        """Switch to buffer storage with room for `slots` more slots in every row, growing (one copy) only when
        full, to `capacity_for` them or to `limit`. From exact storage each row's used slots move to the front, in
        order (`aligned_storage`). The new buffers keep room for more rows (`RowStorage`)."""
        if self.buffered and self.length + slots <= self.capacity:
            return
        if not self.buffered:  # aligned straight into buffers of the grown capacity: one copy of the past, not two
            storage, self.lengths = aligned_storage(self.keys, self.values, self.mask, slots, self.limit,
                                                    rows_for(self.rows))
            self._adopt(storage, self.rows)
            return
        length, rows = self.length, self.rows
        room = self.storage.rows if self.storage is not None else rows_for(rows)
        n_heads, head_dim = self.keys[0].shape[1], self.keys[0].shape[3]
        storage = RowStorage.allocate(room, len(self.keys), n_heads, capacity_for(length + slots, self.limit),
                                      head_dim, self.keys[0].dtype, fresh=self.limit is not None)
        for old, new in zip((*self.keys, *self.values), (*storage.keys, *storage.values)):
            new[:rows, :, :length] = old[:, :, :length]
        storage.mask[:rows, :length] = self.mask[:, :length]
        self._adopt(storage, rows)

    def _adopt(self, storage: RowStorage, rows: int) -> None:
        """Buffers: hold the first `rows` rows of `storage`."""
        self.storage = storage
        self.keys = [k[:rows] for k in storage.keys]
        self.values = [v[:rows] for v in storage.values]
        self.mask = storage.mask[:rows]

    def open_slot(self) -> np.ndarray:
        """Buffers: make room for one more slot in every row, mark each row's next slot used and return those
        slots (rows,); `advance()` once the graph has written them."""
        self.reserve(1)
        slots = self.lengths.copy()
        self.mask[np.arange(self.rows), slots] = 1
        return slots

    def advance(self) -> None:
        """Buffers: the slots of `open_slot` hold the step's keys/values; rows move to their next position (in
        place: a step binding keeps pointing at the same positions array)."""
        np.add(self.lengths, 1, out=self.lengths)
        np.add(self.positions, 1, out=self.positions)

    def feeds(self) -> dict[str, np.ndarray]:
        """Exact storage: the past inputs of the graph."""
        feeds = {}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            key_name, value_name = past_names(i)
            feeds[key_name], feeds[value_name] = k, v
        return feeds

    def append(self, presents: Sequence[np.ndarray], new_mask: np.ndarray, new_positions: np.ndarray) -> None:
        """Adopt the graph's present K/V (flat: layer 0 key, layer 0 value, ...), which hold the past plus the
        new slots; `new_mask` (rows, new) marks the new slots, `new_positions` (rows,) the next positions. Exact
        storage only."""
        self.keys, self.values = list(presents[0::2]), list(presents[1::2])
        self.mask = np.concatenate([self.mask, new_mask.astype(np.int64)], axis=1)
        self.positions = new_positions.astype(np.int64)

    def select(self, rows: np.ndarray) -> None:
        """Keep rows `rows` (indices into the current rows, repeats allowed) in that order.

        A same-size reordering (beams swapping parents) copies only the rows that change, in place; so does a
        departure from buffers in a `RowStorage` (fewer rows, in their order: the rows after a gap move up,
        `_close_up`); anything else gathers the kept rows once, dropping leading slots that none of them uses any
        more."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == self.rows:
            changed = rows != np.arange(self.rows)
            if not changed.any():
                return  # nothing moves: greedy and sampling rows keep their place
            moved = np.flatnonzero(changed)
            if moved.size <= IN_PLACE_REORDER_FRACTION * self.rows:
                sources, used = rows[moved], self.length
                for array in (*self.keys, *self.values):
                    array[moved, :, :used] = array[sources, :, :used]  # the right side is gathered first
                for array in (self.mask, self.positions, *(() if self.lengths is None else (self.lengths,))):
                    array[moved] = array[sources]
                if self.encoder_row is not None:
                    self.encoder_row[moved] = self.encoder_row[sources]
                return
            if not self.buffered and rows.min() >= 0 and self.first_used_slot(rows) == 0:
                self._take(rows)  # a beam step's reorder of exact storage: nothing to trim, one take per array
                return
        merged = KVCache.concatenate([self], rows=[rows], in_place=True)
        if merged is self:
            return
        self.keys, self.values, self.mask, self.positions = merged.keys, merged.values, merged.mask, merged.positions
        self.lengths, self.storage = merged.lengths, merged.storage
        if self.encoder_row is not None:
            self.encoder_row = merged.encoder_row

    def _take(self, rows: np.ndarray) -> None:
        """Exact storage: every array's rows `rows`, in a copy each (what `concatenate` of these rows gives when no
        leading slot goes unused, without its bookkeeping: a beam step at one source reorders 4 rows in ~80 us
        through it)."""
        self.keys = [k.take(rows, axis=0) for k in self.keys]
        self.values = [v.take(rows, axis=0) for v in self.values]
        self.mask, self.positions = self.mask.take(rows, axis=0), self.positions.take(rows)
        if self.encoder_row is not None:
            self.encoder_row = self.encoder_row.take(rows)

    def recycle(self, rows: np.ndarray) -> None:
        """Rows whose content no longer matters (a batch's dead rows, fed padding until the next compaction):
        position 0, so that they never run past the positional table however long they are fed."""
        self.positions[rows] = 0

    def first_used_slot(self, rows: np.ndarray | None = None) -> int:
        """The first slot any of `rows` (default: all) uses; slots before it are left padding (exact storage;
        buffers have none)."""
        if self.buffered:
            return 0
        mask = self.mask[:, : self.length] if rows is None else self.mask[rows, : self.length]
        used = mask.any(axis=0)
        return int(np.argmax(used)) if used.any() else self.length

    @staticmethod
    def concatenate(caches: Sequence[KVCache], encoder_offsets: Sequence[int] | None = None,
                    rows: Sequence[np.ndarray | None] | None = None, in_place: bool = False) -> KVCache:
        """Stack (selected) rows of several caches in one copy. Exact storage: shorter caches are left-padded with
        masked slots and slots that no kept row uses are dropped. If any cache holds buffers, so does the result,
        with room for at least one more slot and for more rows (`RowStorage`): every row keeps its slots from 0
        (exact caches' rows are aligned first) and slots past the longest kept row are dropped.

        `rows[i]`: the rows of cache i to keep, in order (None = all). With `encoder_offsets`, cache i's encoder
        rows are shifted by offsets[i] (its sources' first row in the concatenated encoder output).
        `in_place`: the first cache may be consumed (a running batch that newcomers join): when its storage has
        room for every row and slot of the result, the result is that cache, its kept rows closed up in place and
        the others' written after them (`_can_join`, `_close_up`); otherwise it is left as it was and the result
        is a copy."""
        rows = [np.arange(c.rows) if r is None else np.asarray(r, dtype=np.int64)
                for c, r in zip(caches, rows or [None] * len(caches))]
        for cache, kept in zip(caches, rows):
            if len(kept) and (kept.min() < 0 or kept.max() >= cache.rows):
                raise IndexError(f"row index out of range for a cache of {cache.rows} rows")
        buffered = any(c.buffered for c in caches)
        # (keys, values, mask, lengths or None, first slot to copy, slots to copy) per cache
        sources = []
        for cache, kept in zip(caches, rows):
            if buffered:
                if cache.buffered:
                    keys, values, mask, lengths = cache.keys, cache.values, cache.mask, cache.lengths
                else:
                    aligned, lengths = aligned_storage(cache.keys, cache.values, cache.mask)
                    keys, values, mask = aligned.keys, aligned.values, aligned.mask
                sources.append((keys, values, mask, lengths, 0, int(lengths[kept].max(initial=0))))
            else:
                first = cache.first_used_slot(kept) if len(kept) else cache.length
                sources.append((cache.keys, cache.values, cache.mask, None, first, cache.length - first))
        length = max((width for (*_, width), kept in zip(sources, rows) if len(kept)), default=0)
        total = sum(len(r) for r in rows)
        reference = caches[0]
        encoder_row = None
        if encoder_offsets is not None or reference.encoder_row is not None:
            offsets = encoder_offsets or [0] * len(caches)
            encoder_row = np.concatenate([c.encoder_row[r] + o for c, r, o in zip(caches, rows, offsets)])
        lengths = np.concatenate([src[3][kept] for src, kept in zip(sources, rows)]).astype(np.int64) \
            if buffered else None
        positions = np.concatenate([c.positions[r] for c, r in zip(caches, rows)])
        n_layers, n_heads, head_dim = len(reference.keys), reference.keys[0].shape[1], reference.keys[0].shape[3]
        if in_place and reference._can_join(rows[0], sources[1:], length, total):
            # the kept rows closed up where they are; the others' gathered after them, into the same storage
            reference._close_up(rows[0])
            storage, capacity, placed = reference.storage, reference.capacity, 1
        else:
            # a join's or a gather's copy keeps the headroom: its rows may be short-lived, and fresh memory is paid
            # for page by page; the `limit` is taken when the buffers fill up (`reserve`)
            capacity, placed = (capacity_for(length + 1) if buffered else length), 0
            storage = RowStorage.allocate(rows_for(total), n_layers, n_heads, capacity, head_dim,
                                          reference.keys[0].dtype) if buffered else None

        def gather(layer: int | None, values: bool = False) -> np.ndarray:
            """Layer `layer`'s keys (or values), or the mask (None), of every kept row: each slot written once,
            the copied ones by the gather, the padding ones (masked, zero as in a fresh cache) by a fill, or, in
            a storage (zero wherever no row is), not at all; the first `placed` caches' rows are in place already."""
            if storage is not None:
                out = (storage.mask if layer is None else (storage.values if values else storage.keys)[layer])[:total]
            elif layer is None:
                out = np.empty((total, capacity), np.int64)
            else:
                out = np.empty((total, n_heads, capacity, head_dim), reference.keys[0].dtype)
            axis = 1 if layer is None else 2
            start = sum(len(kept) for kept in rows[:placed])
            for (keys, values_, mask, _, first, width), kept in zip(sources[placed:], rows[placed:]):
                target = out[start : start + len(kept)]
                at = slice(0, width) if buffered else slice(length - width, length)  # aligned / left-padded
                if len(kept) and width:
                    source = mask if layer is None else (values_ if values else keys)[layer]
                    np.take(source[(slice(None),) * axis + (slice(first, first + width),)], kept, axis=0,
                            out=target[(slice(None),) * axis + (at,)], mode="clip")
                for padding in (slice(0, at.start), slice(at.stop, capacity)):
                    if storage is None and padding.stop > padding.start:
                        target[(slice(None),) * axis + (padding,)] = 0
                start += len(kept)
            return out

        keys, values = [gather(i) for i in range(n_layers)], [gather(i, values=True) for i in range(n_layers)]
        mask = gather(None)
        if not placed:
            return KVCache(keys, values, mask, positions, encoder_row, lengths, limit=reference.limit, storage=storage)
        reference.keys, reference.values, reference.mask = keys, values, mask  # the storage's first `total` rows
        reference.positions, reference.encoder_row, reference.lengths = positions, encoder_row, lengths
        return reference

    def _can_join(self, kept: np.ndarray, sources: Sequence[tuple], length: int, total: int) -> bool:
        """Whether `concatenate(in_place=True)` can keep this cache's rows `kept` (in increasing order) where they
        are, closed up, and write the other caches' kept rows (`sources`: their buffers as `concatenate` reads
        them) after them in its storage: `total` rows whose longest uses `length` slots. Not when the storage lacks
        rows, or slots for them and the next step's, or is read by a source; nor, for an attention that reads the
        whole buffer (no `limit`), when it is wider than the headroom twice over the longest row, which a copy
        trims; nor for sources of another shape (layers, heads, head dim)."""
        if (self.storage is None or total > self.storage.rows or length + 1 > self.capacity
                or any(source[0] is self.keys for source in sources)
                or (len(kept) > 1 and (np.diff(kept) <= 0).any())):
            return False
        if self.limit is None and self.capacity > capacity_for(int(length * (1 + HEADROOM))):
            return False
        shape = (len(self.keys), *self.keys[0].shape[1::2])
        return all((len(keys), *keys[0].shape[1::2]) == shape for keys, *_ in sources)

    def _close_up(self, kept: np.ndarray) -> None:
        """Buffers in a `RowStorage`: rows `kept` (increasing) of the keys, values and mask moved up in place to
        their new index, and the rows left behind zeroed (every unused slot of the storage stays zero); the caller
        adopts the rows and sets their positions and lengths."""
        length, n = self.length, len(kept)
        moved = np.flatnonzero(kept != np.arange(n))
        for array in (*self.storage.keys, *self.storage.values):
            if moved.size:
                array[moved, :, :length] = array[kept[moved], :, :length]  # the right side is gathered first
            array[n : self.rows, :, :length] = 0
        mask = self.storage.mask
        if moved.size:
            mask[moved, :length] = mask[kept[moved], :length]
        mask[n : self.rows, :length] = 0
