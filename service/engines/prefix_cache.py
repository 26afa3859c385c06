"""Automatic prefix caching for the GPT: the prompt pass's K/V (and logits) kept in blocks of `BLOCK_TOKENS` tokens,
so that a prompt that starts like an earlier one runs its pass over the rest only.

After vLLM's automatic prefix caching (a fixed pool of blocks keyed by the chain of their tokens, reference-counted
while in use, the least recently used evicted) and ONNX Runtime GenAI's check of a block's tokens before reuse: a
block is found by (its parent block, its tokens), so it is reused only when every token before it matches too; no
hash can collide. One cache per loaded engine: the model version and weights variant are in every key by
construction. The pool is allocated once, as large as the budget; its pages are touched as blocks fill them.
Touching a chain moves it to the recent end from its last block to its first, so parents outlive their children.

Why a hit gives the same numbers as a miss: a prompt pass over S >= 2 tokens after cached K/V is bit-identical to
the pass over the whole prompt (docs/prefix_caching.md), so a hit leaves at least `MIN_SUFFIX_TOKENS` to compute;
`service.engines.prefix_pass.suffix_exact` checks that on the host at load.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count

import numpy as np

BLOCK_TOKENS = 16  # tokens per cached block (vLLM's default block size)
# a pass over one new token takes another MatMul path (M = 1) whose last bits differ from the whole prompt's:
# a hit always leaves at least two tokens to compute
MIN_SUFFIX_TOKENS = 2
MIB = 1 << 20


class BlockPool:
    """Every block's storage: keys and values (slot, 2 * layers, heads, BLOCK_TOKENS, head_dim: layer 0 key, layer
    0 value, ...) and logits (slot, BLOCK_TOKENS, V), and the free slots."""

    def __init__(self, slots: int, kv_shape: tuple[int, ...], vocab: int, dtype: np.dtype):
        # written once now: every page is the process's from the start (a block copied into a page touched for the
        # first time pays its page faults, ~0.5 ms a block, inside a request)
        self.kv = np.zeros((slots, *kv_shape), dtype)
        self.logits = np.zeros((slots, BLOCK_TOKENS, vocab), np.float32)
        self.kv.fill(0)
        self.logits.fill(0)
        self.free = list(range(slots - 1, -1, -1))

    @staticmethod
    def block_bytes(kv_shape: tuple[int, ...], vocab: int, dtype: np.dtype) -> int:
        return int(np.prod(kv_shape)) * np.dtype(dtype).itemsize + BLOCK_TOKENS * vocab * 4


@dataclass(eq=False)
class Block:
    """`BLOCK_TOKENS` prompt positions after `parent`'s: their `tokens` and where the pool holds them; `pins`:
    prefills reading it now (not evicted meanwhile)."""

    id: int
    parent: int  # the parent block's id (0: the first block of a prompt)
    tokens: bytes
    slot: int
    pool: BlockPool
    pins: int = 0

    @property
    def kv(self) -> np.ndarray:
        return self.pool.kv[self.slot]

    @property
    def logits(self) -> np.ndarray:
        return self.pool.logits[self.slot]


@dataclass
class PrefixStats:
    """Totals since start: prompt tokens looked up and found (vLLM's `prefix_cache_queries` / `_hits`), blocks
    evicted; and the bytes the blocks held now take."""

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
    """Blocks in a pool of at most `budget_bytes`; thread-safe (several decoding workers share an engine)."""

    def __init__(self, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError(f"a prefix cache needs a positive budget, got {budget_bytes} bytes")
        self.budget_bytes = budget_bytes
        self._pool: BlockPool | None = None  # made by `reserve` or at the first insert, with the model's shapes
        self._block_bytes = 0
        self._blocks: OrderedDict[tuple[int, bytes], Block] = OrderedDict()  # least recently used first
        self._ids = count(1)
        self._lock = threading.Lock()
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def capacity(self) -> int:
        """The blocks its pool holds (0 until the pool is made: `reserve` or the first insert)."""
        return 0 if self._pool is None else len(self._pool.kv)

    def match(self, prompt: Sequence[int]) -> list[Block]:
        """The cached blocks of `prompt`'s longest cached prefix of at most `usable_tokens` tokens, in order,
        touched and pinned until `release`; counts the query."""
        usable = usable_tokens(len(prompt))
        chain: list[Block] = []
        with self._lock:
            parent = 0
            for start in range(0, usable, BLOCK_TOKENS):
                block = self._blocks.get(_key(parent, prompt[start : start + BLOCK_TOKENS]))
                if block is None:
                    break
                block.pins += 1
                chain.append(block)
                parent = block.id
            self._touch(chain)
            self.stats.queried_tokens += len(prompt)
            self.stats.hit_tokens += len(chain) * BLOCK_TOKENS
        return chain

    def release(self, chains: Sequence[Sequence[Block]]) -> None:
        """Unpin the chains `match` returned: their blocks may be evicted again."""
        with self._lock:
            for chain in chains:
                for block in chain:
                    block.pins -= 1

    def insert(self, prompt: Sequence[int], kv: Sequence[np.ndarray], logits: np.ndarray, row: int,
               start_block: int = 0, known: Sequence[Block] = ()) -> None:
        """Keep the whole blocks of `prompt` from block `start_block` on, from the pass that computed them: `kv`
        the pass's presents (flat: layer 0 key, layer 0 value, ...; (rows, heads, slots, head_dim), row `row`'s
        slot t holding position t) and `logits` (slots, V) the row's logits from position `start_block *
        BLOCK_TOKENS` on. `known`: the blocks before `start_block` (the hit the pass started from). A block not
        kept yet takes a free slot, else the least recently used unpinned block's."""
        blocks = len(prompt) // BLOCK_TOKENS
        if blocks <= start_block:
            return
        with self._lock:
            pool = self._pool or self._make_pool(kv, logits.shape[-1])
            parent = known[-1].id if known else 0
            chain, new = list(known), []
            for index in range(start_block, blocks):
                first = index * BLOCK_TOKENS
                key = _key(parent, prompt[first : first + BLOCK_TOKENS])
                block = self._blocks.get(key)
                if block is None:
                    slot = self._free_slot()
                    if slot is None:  # every slot is pinned: keep what is kept so far
                        break
                    block = self._blocks[key] = Block(next(self._ids), parent, key[1], slot, pool)
                    self.stats.bytes += self._block_bytes
                    new.append(index)
                block.pins += 1  # the chain so far stays while later blocks take slots
                chain.append(block)
                parent = block.id
            for block in chain[len(known):]:
                block.pins -= 1
            self._touch(chain)
            self._copy(pool, [chain[i - start_block + len(known)].slot for i in new], new, kv, logits, row,
                       start_block)

    def reserve(self, layers: int, heads: int, head_dim: int, vocab: int, dtype: np.dtype = np.float32) -> None:
        """Make the pool now (its memory taken at load, not by the first requests), for a model of these shapes."""
        with self._lock:
            if self._pool is None:
                self._new_pool((2 * layers, heads, BLOCK_TOKENS, head_dim), vocab, np.dtype(dtype))

    def _make_pool(self, kv: Sequence[np.ndarray], vocab: int) -> BlockPool:
        return self._new_pool((len(kv), kv[0].shape[1], BLOCK_TOKENS, kv[0].shape[3]), vocab, kv[0].dtype)

    def _new_pool(self, shape: tuple[int, ...], vocab: int, dtype: np.dtype) -> BlockPool:
        self._block_bytes = BlockPool.block_bytes(shape, vocab, dtype)
        self._pool = BlockPool(self.budget_bytes // self._block_bytes, shape, vocab, dtype)
        return self._pool

    @staticmethod
    def _copy(pool: BlockPool, slots: list[int], indices: list[int], kv: Sequence[np.ndarray], logits: np.ndarray,
              row: int, start_block: int) -> None:
        """Blocks `indices` of the row (consecutive: after a new block every block is new) into `slots`."""
        if not slots:
            return
        n, heads, head_dim = len(slots), kv[0].shape[1], kv[0].shape[3]
        window = slice(indices[0] * BLOCK_TOKENS, (indices[-1] + 1) * BLOCK_TOKENS)
        for i, present in enumerate(kv):
            pool.kv[slots, i] = present[row, :, window].reshape(heads, n, BLOCK_TOKENS, head_dim).swapaxes(0, 1)
        done = (indices[0] - start_block) * BLOCK_TOKENS
        pool.logits[slots] = logits[done : done + n * BLOCK_TOKENS].reshape(n, BLOCK_TOKENS, -1)

    def _free_slot(self) -> int | None:
        """A free slot, else the slot of the least recently used unpinned block, evicted; None if all are pinned."""
        if self._pool.free:
            return self._pool.free.pop()
        for key, block in self._blocks.items():
            if not block.pins:
                del self._blocks[key]
                self.stats.bytes -= self._block_bytes
                self.stats.evicted_blocks += 1
                return block.slot
        return None

    def _touch(self, chain: list[Block]) -> None:
        """Most recently used: the chain's blocks, the first last (a parent outlives its children)."""
        for block in reversed(chain):
            self._blocks.move_to_end((block.parent, block.tokens))

    def clear(self) -> None:
        """Evict every unpinned block."""
        with self._lock:
            for key, block in list(self._blocks.items()):
                if not block.pins:
                    del self._blocks[key]
                    self._pool.free.append(block.slot)
                    self.stats.bytes -= self._block_bytes
                    self.stats.evicted_blocks += 1


def past_of(chains: Sequence[Sequence[Block]]) -> list[np.ndarray]:
    """The K/V of rows that hit as many blocks each: flat (layer 0 key, layer 0 value, ...), each (rows, heads,
    blocks * BLOCK_TOKENS, head_dim), each block copied once into its place."""
    pool, blocks = chains[0][0].pool, len(chains[0])
    kinds, heads, _, head_dim = pool.kv.shape[1:]
    past = np.empty((kinds, len(chains), heads, blocks, BLOCK_TOKENS, head_dim), pool.kv.dtype)
    for row, chain in enumerate(chains):
        for index, block in enumerate(chain):
            past[:, row, :, index] = pool.kv[block.slot]
    return list(past.reshape(kinds, len(chains), heads, blocks * BLOCK_TOKENS, head_dim))


def logits_of(chain: Sequence[Block]) -> np.ndarray:
    """The logits at every position of a chain's blocks (tokens, V)."""
    return chain[0].pool.logits[[block.slot for block in chain]].reshape(-1, chain[0].pool.logits.shape[-1])
