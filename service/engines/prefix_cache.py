"""Automatic prefix caching for the GPT: the prompt pass's K/V (and logits) kept in blocks of `BLOCK_TOKENS` tokens,
so that a prompt that starts like an earlier one runs its pass over the rest only.

After vLLM's automatic prefix caching (blocks keyed by the chain of their tokens, least-recently-used eviction
under a budget) and ONNX Runtime GenAI's check of a block's tokens before reuse: a block is found by (its parent
block, its tokens), so two blocks are one only when every token before them matches too; no hash can collide.
One cache per loaded engine, so the model version and weights variant are part of every key by construction.
Touching a chain moves its blocks to the recent end from the last to the first, so a parent is always more recent
than its children and eviction takes leaves first. Blocks are immutable numpy arrays: a hit copies them into
the batch's cache; eviction drops a reference (a copy in use is unaffected).

Why a hit gives the same numbers as a miss: the prompt graph's pass over a suffix of S >= 2 tokens after the
cached K/V is bit-identical to its pass over the whole prompt (every position's logits and K/V; measured:
docs/prefix_caching.md), so `usable_tokens` leaves at least `MIN_SUFFIX_TOKENS` to compute, and
`service.engines.prefix_pass.suffix_exact` checks the property on the host at load (off if it fails there).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count

import numpy as np

BLOCK_TOKENS = 16  # tokens per cached block (vLLM's default block size)
# a pass over one new token takes another MatMul path (M = 1) whose last bits differ from the whole prompt's:
# a hit always leaves at least two tokens to compute
MIN_SUFFIX_TOKENS = 2
MIB = 1 << 20


@dataclass(eq=False)
class Block:
    """`BLOCK_TOKENS` prompt positions: `tokens`, their keys and values (2 * layers, heads, BLOCK_TOKENS, head_dim:
    layer 0 key, layer 0 value, ...) and the logits at each of them (BLOCK_TOKENS, V), after `parent`'s."""

    id: int
    parent: int  # the parent block's id (0: the first block of a prompt)
    tokens: bytes
    kv: np.ndarray
    logits: np.ndarray
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = self.kv.nbytes + self.logits.nbytes


@dataclass
class PrefixStats:
    """Totals since start: prompt tokens looked up and found (vLLM's `prefix_cache_queries` / `_hits`), blocks
    evicted; and the bytes held now."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0
    bytes: int = 0


def usable_tokens(prompt_length: int) -> int:
    """The most prompt tokens a hit may cover: whole blocks, leaving at least `MIN_SUFFIX_TOKENS` to compute."""
    return max(0, (prompt_length - MIN_SUFFIX_TOKENS) // BLOCK_TOKENS * BLOCK_TOKENS)


def _key(parent: int, tokens: Sequence[int]) -> tuple[int, bytes]:
    return parent, np.asarray(tokens, dtype=np.int64).tobytes()


class PrefixCache:
    """Blocks under a byte budget; thread-safe (several decoding workers share an engine)."""

    def __init__(self, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError(f"a prefix cache needs a positive budget, got {budget_bytes} bytes")
        self.budget_bytes = budget_bytes
        self._blocks: OrderedDict[tuple[int, bytes], Block] = OrderedDict()  # least recently used first
        self._ids = count(1)
        self._lock = threading.Lock()
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, prompt: Sequence[int]) -> list[Block]:
        """The cached blocks of `prompt`'s longest cached prefix of at most `usable_tokens` tokens, in order
        (touched: most recently used); counts the query."""
        usable = usable_tokens(len(prompt))
        chain: list[Block] = []
        with self._lock:
            parent = 0
            for start in range(0, usable, BLOCK_TOKENS):
                block = self._blocks.get(_key(parent, prompt[start : start + BLOCK_TOKENS]))
                if block is None:
                    break
                chain.append(block)
                parent = block.id
            self._touch(chain)
            self.stats.queried_tokens += len(prompt)
            self.stats.hit_tokens += len(chain) * BLOCK_TOKENS
        return chain

    def insert(self, prompt: Sequence[int], kv: Sequence[np.ndarray], logits: np.ndarray, row: int,
               start_block: int = 0, known: Sequence[Block] = ()) -> None:
        """Keep the whole blocks of `prompt` from block `start_block` on, from the pass that computed them: `kv`
        the pass's presents (flat: layer 0 key, layer 0 value, ...; (rows, heads, slots, head_dim), row `row`'s
        slot t holding position t) and `logits` (slots, V) the row's logits at positions `start_block *
        BLOCK_TOKENS` onwards. `known`: the blocks before `start_block` (the hit the pass started from)."""
        blocks = len(prompt) // BLOCK_TOKENS
        if blocks <= start_block:
            return
        with self._lock:
            parent = known[-1].id if known else 0
            chain = list(known)
            for index in range(start_block, blocks):
                first = index * BLOCK_TOKENS
                key = _key(parent, prompt[first : first + BLOCK_TOKENS])
                block = self._blocks.get(key)
                if block is None:
                    window = slice(first, first + BLOCK_TOKENS)
                    done = (index - start_block) * BLOCK_TOKENS
                    block = Block(next(self._ids), parent, key[1],
                                  np.stack([present[row, :, window] for present in kv]),
                                  logits[done : done + BLOCK_TOKENS].copy())
                    self._blocks[key] = block
                    self.stats.bytes += block.nbytes
                chain.append(block)
                parent = block.id
            self._touch(chain)
            self._evict()

    def _touch(self, chain: list[Block]) -> None:
        """Most recently used: the chain's blocks, the first last (a parent outlives its children)."""
        for block in reversed(chain):
            self._blocks.move_to_end((block.parent, block.tokens))

    def _evict(self) -> None:
        while self.stats.bytes > self.budget_bytes and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self.stats.bytes -= block.nbytes
            self.stats.evicted_blocks += 1

    def clear(self) -> None:
        with self._lock:
            self.stats.evicted_blocks += len(self._blocks)
            self._blocks.clear()
            self.stats.bytes = 0


def past_of(chains: Sequence[Sequence[Block]]) -> list[np.ndarray]:
    """The K/V of rows that hit as many blocks each: flat (layer 0 key, layer 0 value, ...), each (rows, heads,
    blocks * BLOCK_TOKENS, head_dim), one copy."""
    rows, first = len(chains), chains[0][0].kv
    slots = len(chains[0]) * BLOCK_TOKENS
    past = [np.empty((rows, first.shape[1], slots, first.shape[3]), first.dtype) for _ in range(first.shape[0])]
    for row, chain in enumerate(chains):
        for index, block in enumerate(chain):
            window = slice(index * BLOCK_TOKENS, (index + 1) * BLOCK_TOKENS)
            for array, kv in zip(past, block.kv):
                array[row, :, window] = kv
    return past


def logits_of(chain: Sequence[Block]) -> np.ndarray:
    """The logits at every position of a chain's blocks (tokens, V)."""
    return np.concatenate([block.logits for block in chain])
