"""Verifying draft tokens on the GPT's prompt graph: one multi-token pass over the rows' cached keys/values, then
only the accepted tokens' keys/values kept (vLLM's and llama.cpp's n-gram speculation verify the same way; the
drafts come from `service.decoding.ngram_draft`, the acceptance from the searches, `service.scheduling.speculation`).

`verify_drafts` feeds each row its pending token and its draft (right-padded, at the row's next positions) after the
cache's past on ``decoder.onnx``, which returns the logits at every new position; `Verification.commit(kept)` then
writes each row's first ``kept[row]`` new slots into the cache (exact storage: the presents adopted, the rejected
slots masked; buffers: the kept slots written in place after the row's used ones) and moves the row on.

Exactness: the pass is bit-identical to a prompt pass over the same text, not to the step graph's one-token steps:
outputs may differ from plain greedy decoding in a logit's last bits, and flip a near-tie (docs/speculation.md).
Only float caches on the host are verified: no int8 cache (`+kv8`), none in a device's memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from service.engines import onnx_schema as schema
from service.engines.kv_cache import KVCache

__all__ = ["Verification", "verify_drafts"]

# (feeds) -> (logits (R, S, V), presents flat: layer 0 key, layer 0 value, ...): one run of the prompt graph
PassRunner = Callable[[dict[str, np.ndarray]], tuple[np.ndarray, list[np.ndarray]]]


@dataclass
class Verification:
    """A verify pass's logits, (rows, S, V): ``logits[row, i]`` are those after ``fed[row][: i + 1]``; and what
    `commit` needs to keep the accepted slots."""

    logits: np.ndarray
    cache: KVCache
    presents: list[np.ndarray]  # (rows, heads, past + S, head_dim) each
    past: int  # slots of the past the pass read
    new_mask: np.ndarray  # (rows, S) int64: 1 where a fed token was real

    def commit(self, kept: np.ndarray) -> None:
        """Keep each row's first ``kept[row]`` fed tokens (its pending token and its accepted draft tokens; 0 for a
        row that keeps nothing, a dead one) in the cache and move the row on by as many positions."""
        kept = np.asarray(kept, np.int64)
        S = self.new_mask.shape[1]
        if (kept < 0).any() or (kept > self.new_mask.sum(axis=1)).any():
            raise ValueError("a row cannot keep more tokens than it was fed")
        cache = self.cache
        if not cache.buffered:
            mask = self.new_mask * (np.arange(S) < kept[:, None])
            cache.append(self.presents, mask, cache.positions + kept)
            return
        cache.reserve(int(kept.max(initial=0)))  # may move the buffers: written after
        rows = np.repeat(np.arange(cache.rows), kept)  # (N,) a (row, slot) pair per kept token
        offsets = np.arange(len(rows)) - np.repeat(np.cumsum(kept) - kept, kept)  # 0, 1, ... within each row
        targets = cache.lengths[rows] + offsets
        sources = self.past + offsets
        for buffer, present in zip((*cache.keys, *cache.values), (*self.presents[0::2], *self.presents[1::2])):
            buffer[rows, :, targets] = present[rows, :, sources]  # (N, heads, head_dim)
        cache.mask[rows, targets] = 1
        np.add(cache.lengths, kept, out=cache.lengths)
        np.add(cache.positions, kept, out=cache.positions)  # in place: a step binding points at this array


def verify_drafts(cache: KVCache, fed: Sequence[Sequence[int]], run: PassRunner, pad_id: int,
                  context_length: int) -> Verification:
    """One pass over ``cache`` feeding ``fed[row]`` (its pending token, then its draft; at least one token a row)
    at the row's next positions -> the `Verification` (nothing in the cache changes until its `commit`)."""
    R, S = cache.rows, max(len(tokens) for tokens in fed)
    if len(fed) != R or min(len(tokens) for tokens in fed) < 1:
        raise ValueError(f"need one or more tokens for each of the {R} rows")
    counts = np.array([len(tokens) for tokens in fed], np.int64)
    new_mask = (np.arange(S) < counts[:, None]).astype(np.int64)  # (R, S)
    positions = np.where(new_mask == 1, cache.positions[:, None] + np.arange(S), 0)
    if int(positions.max()) >= context_length:
        raise ValueError(f"a draft runs past the context length {context_length}")
    ids = np.full((R, S), pad_id, np.int64)
    for row, tokens in enumerate(fed):
        ids[row, : len(tokens)] = tokens
    past = cache.length
    if cache.buffered:  # each row's slots from 0: the used ones only, contiguous as the graph wants them
        keys = [np.ascontiguousarray(k[:, :, :past]) for k in cache.keys]
        values = [np.ascontiguousarray(v[:, :, :past]) for v in cache.values]
        feeds = {name: array for i in range(len(keys)) for name, array in zip(schema.past_names(i),
                                                                              (keys[i], values[i]))}
    else:
        feeds = cache.feeds()
    feeds.update({schema.INPUT_IDS: ids, schema.POSITION_IDS: positions,
                  schema.ATTENTION_MASK: np.concatenate([cache.mask[:, :past], new_mask], axis=1)})
    logits, presents = run(feeds)
    return Verification(logits, cache, presents, past, new_mask)
