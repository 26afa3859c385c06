"""The KV cache kept in the execution provider's memory: `service.engines.kv_cache.KVCache`'s layout and operations,
its keys and values `OrtValue`s that never leave the device (a GPU's memory under the CUDA provider).

The keys/values are moved by `service.engines.device_ops` (small ONNX graphs on the same provider); the mask, the
positions, the slots in use and the rows' sources stay numpy arrays on the host (int64, a few per row and slot): the
step graph reads them each step, the searches and the scheduler read and set them. The two storage modes are
`KVCache`'s (`service.engines.kv_storage`): exact (a concatenating graph's presents adopted each step) and buffers
(written in place by the step graph, `service.engines.device_step`), with the same invariant: in buffers every row's
slots start at 0, whatever the batch, so that a row's logits are those it would get alone. Joins and reorders
always make fresh device tensors (the provider's memory arena recycles them) where `KVCache` works in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from service.engines.device_ops import ORT_TYPES, DeviceOps
from service.engines.kv_storage import capacity_for
from service.engines.onnx_schema import past_names


@dataclass
class DeviceKVCache:
    keys: list[ort.OrtValue]  # per layer (rows, heads, slots, head_dim), on the device
    values: list[ort.OrtValue]
    mask: np.ndarray  # (rows, slots) int64, host
    positions: np.ndarray  # (rows,) int64, host
    ops: DeviceOps
    encoder_row: np.ndarray | None = None
    lengths: np.ndarray | None = None  # buffers: (rows,) slots in use; None: exact storage
    limit: int | None = None  # buffers: the capacity they grow to at once (`KVCache.limit`)
    # the bindings `service.engines.device_step.DeviceStep` made for these tensors, if any
    step_binding: object | None = field(default=None, repr=False, compare=False)

    @classmethod
    def empty(cls, rows: int, n_layers: int, n_heads: int, head_dim: int, dtype, ops: DeviceOps,
              limit: int | None = None) -> DeviceKVCache:
        """Zero slots per row, as a prompt pass or a first step wants it."""
        blank = np.zeros((rows, n_heads, 0, head_dim), dtype)
        return cls([ops.placement.upload(blank) for _ in range(n_layers)],
                   [ops.placement.upload(blank) for _ in range(n_layers)],
                   np.zeros((rows, 0), np.int64), np.zeros(rows, np.int64), ops, limit=limit)

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]

    @property
    def length(self) -> int:
        """Slots in use (buffers: by the longest row)."""
        return self.capacity if self.lengths is None else int(self.lengths.max(initial=0))

    @property
    def buffered(self) -> bool:
        return self.lengths is not None

    @property
    def tensors(self) -> list[ort.OrtValue]:
        return [*self.keys, *self.values]

    def _adopt(self, tensors: Sequence[ort.OrtValue]) -> None:
        half = len(tensors) // 2
        self.keys, self.values = list(tensors[:half]), list(tensors[half:])

    def feeds(self) -> dict[str, ort.OrtValue]:
        """Exact storage: the past inputs of a concatenating graph."""
        return {name: value for i, (k, v) in enumerate(zip(self.keys, self.values))
                for name, value in zip(past_names(i), (k, v))}

    def append(self, presents: Sequence[ort.OrtValue], new_mask: np.ndarray, new_positions: np.ndarray) -> None:
        """Exact storage: adopt the graph's presents (layer 0 key, layer 0 value, ...; past + new slots, on the
        device); `new_mask` (rows, new) marks the new slots."""
        self.keys, self.values = list(presents[0::2]), list(presents[1::2])
        self.mask = np.concatenate([self.mask, new_mask.astype(np.int64)], axis=1)
        self.positions = new_positions.astype(np.int64)

    def reserve(self, slots: int) -> None:
        """Buffers with room for `slots` more slots in every row (growing to `capacity_for` them, or to `limit`);
        exact storage becomes buffers, which needs its rows aligned (each row's slots from 0: a right-padded prompt
        pass's presents, or an empty cache)."""
        if self.buffered and self.length + slots <= self.capacity:
            return
        if not self.buffered:
            lengths = self.mask.sum(axis=1).astype(np.int64)
            if not (self.mask == (np.arange(self.capacity) < lengths[:, None])).all():
                raise ValueError("a device cache in exact storage must hold each row's slots from slot 0 to become "
                                 "buffers (right-padded prompts)")
            self.lengths = lengths
        length = self.length
        capacity = capacity_for(length + slots, self.limit)
        kept = min(length, self.capacity)
        self._adopt(self.ops.window(self.tensors, 0, kept, 0, capacity - kept))
        mask = np.zeros((self.rows, capacity), np.int64)
        mask[:, :kept] = self.mask[:, :kept]
        self.mask = mask

    def open_slot(self) -> np.ndarray:
        """Buffers: room for one more slot per row, each row's next slot marked used -> those slots (rows,);
        `advance()` once the step graph has written them."""
        self.reserve(1)
        slots = self.lengths.copy()
        self.mask[np.arange(self.rows), slots] = 1
        return slots

    def advance(self) -> None:
        np.add(self.lengths, 1, out=self.lengths)
        np.add(self.positions, 1, out=self.positions)

    def select(self, rows: np.ndarray) -> None:
        """Keep rows `rows` (repeats allowed) in that order: a same-size reorder gathers every row on the device
        (the slots stay as they are); anything else is `concatenate` of these rows, which trims unused slots as
        `KVCache.select` does."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == self.rows:
            if (rows == np.arange(self.rows)).all():
                return
            self._adopt(self.ops.gather(self.tensors, rows))
            self.mask, self.positions = self.mask[rows], self.positions[rows]
            if self.lengths is not None:
                self.lengths = self.lengths[rows]
            if self.encoder_row is not None:
                self.encoder_row = self.encoder_row[rows]
            return
        merged = DeviceKVCache.concatenate([self], rows=[rows])
        self.keys, self.values, self.mask, self.positions = merged.keys, merged.values, merged.mask, merged.positions
        self.lengths, self.encoder_row = merged.lengths, merged.encoder_row

    def recycle(self, rows: np.ndarray) -> None:
        """Rows whose content no longer matters: position 0 (`KVCache.recycle`)."""
        self.positions[rows] = 0

    def first_used_slot(self, rows: np.ndarray | None = None) -> int:
        """The first slot any of `rows` uses (exact storage; buffers have no left padding)."""
        if self.buffered:
            return 0
        mask = self.mask if rows is None else self.mask[rows]
        used = mask.any(axis=0)
        return int(np.argmax(used)) if used.any() else self.capacity

    @staticmethod
    def concatenate(caches: Sequence[DeviceKVCache], encoder_offsets: Sequence[int] | None = None,
                    rows: Sequence[np.ndarray | None] | None = None, in_place: bool = False) -> DeviceKVCache:
        """Stack (selected) rows of several caches into a fresh one, as `KVCache.concatenate` does: exact storage
        left-pads the shorter caches and drops the slots no kept row uses; buffers (if any cache holds them; an
        exact one must then be aligned, `reserve`) keep each row's slots from 0, with room for one more slot.
        `in_place` is accepted for `KVCache`'s signature: a device join always writes fresh tensors."""
        rows = [np.arange(c.rows) if r is None else np.asarray(r, dtype=np.int64)
                for c, r in zip(caches, rows or [None] * len(caches))]
        for cache, kept in zip(caches, rows):
            if len(kept) and (kept.min() < 0 or kept.max() >= cache.rows):
                raise IndexError(f"row index out of range for a cache of {cache.rows} rows")
        reference = caches[0]
        buffered = any(c.buffered for c in caches)
        if buffered:
            for cache in caches:
                cache.reserve(0)  # exact ones become buffers (aligned)
        kept_parts = [(c, r) for c, r in zip(caches, rows) if len(r)]
        if buffered:
            length = max((int(c.lengths[r].max()) for c, r in kept_parts), default=0)
            capacity = capacity_for(length + 1)  # a join keeps the headroom; `reserve` takes the `limit` when full
            windows = [(0, min(length, c.capacity), 0) for c, _ in kept_parts]  # (first slot, end, left padding)
        else:
            spans = [(c.first_used_slot(r), c.capacity) for c, r in kept_parts]
            capacity = max((end - first for first, end in spans), default=0)
            windows = [(first, end, capacity - (end - first)) for first, end in spans]
        parts, masks = [], []
        for (cache, kept), (first, end, left) in zip(kept_parts, windows):
            tensors = cache.tensors
            if not (len(kept) == cache.rows and (kept == np.arange(cache.rows)).all()):
                tensors = reference.ops.gather(tensors, kept)
            right = capacity - left - (end - first)
            if (first, end, left, right) != (0, cache.capacity, 0, 0):
                tensors = reference.ops.window(tensors, first, end, left, right)
            parts.append(tensors)
            mask = np.zeros((len(kept), capacity), np.int64)
            mask[:, left : left + end - first] = cache.mask[kept, first:end]
            masks.append(mask)
        if not parts:  # no row kept: an empty cache of the same shape
            shape = reference.keys[0].shape()
            empty = DeviceKVCache.empty(0, len(reference.keys), shape[1], shape[3],
                                        ORT_TYPES[reference.keys[0].data_type()], reference.ops, reference.limit)
            empty.lengths = np.zeros(0, np.int64) if buffered else None
            return empty
        merged = DeviceKVCache([], [], np.concatenate(masks), np.concatenate(
            [c.positions[r] for c, r in zip(caches, rows)]).astype(np.int64), reference.ops, limit=reference.limit)
        merged._adopt(reference.ops.concat(parts))
        if buffered:
            merged.lengths = np.concatenate([c.lengths[r] for c, r in zip(caches, rows)]).astype(np.int64)
        if encoder_offsets is not None or reference.encoder_row is not None:
            offsets = encoder_offsets or [0] * len(caches)
            merged.encoder_row = np.concatenate([c.encoder_row[r] + o for c, r, o in zip(caches, rows, offsets)])
        return merged
