"""Automatic prefix caching (`service.engines.prefix_cache`, `service.engines.prefix_pass`): the block store's keys,
budget and eviction order; and on the released GPT, in the variants the service runs, a prompt pass that starts
from cached blocks gives the same numbers as one without a cache, bit for bit: next-token logits, the logits at
every prompt position (prompt log-probabilities), the K/V of every prompt slot, and the decoding steps after it,
for batches mixing hits of several lengths and misses. A host whose suffix pass differs keeps no cache and says why.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.engines.gpt import GPTEngine
from service.engines.prefix_cache import (BLOCK_TOKENS, MIN_SUFFIX_TOKENS, PrefixCache, logits_of, past_of,
                                          usable_tokens)
from service.engines.prefix_pass import suffix_exact
from service.engines.runtime import RuntimeOptions
from service.repository import ModelRepository
from tests.support import ROOT

RELEASE_REPOSITORY = ROOT / "model_repository"
LAYERS, HEADS, HEAD_DIM, VOCAB = 2, 3, 4, 5
BUDGET = 64 << 20
STEPS = 6
SHAKESPEARE = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\nFirst Citizen:\n"
               "You are all resolved rather to die than to famish?\n\nAll:\nResolved. resolved.\n\nFirst Citizen:\n"
               "First, you know Caius Marcius is chief enemy to the people.\n")
TAILS = ["ROMEO:\nWhat light", "O", "KING", "MENENIUS:\nWhy, masters, my good friends,", "", "All:\nWe know't."]


def _pass(rows: int, slots: int, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """A fake prompt pass's presents (flat, (rows, heads, slots, head_dim)) and one row's logits (slots, V)."""
    rng = np.random.default_rng(seed)
    kv = [rng.standard_normal((rows, HEADS, slots, HEAD_DIM)).astype(np.float32) for _ in range(2 * LAYERS)]
    return kv, rng.standard_normal((slots, VOCAB)).astype(np.float32)


def matched(cache: PrefixCache, prompt) -> list:
    """`match`, released at once (a prefill holds its chains only while its passes run)."""
    chain = cache.match(prompt)
    cache.release([chain])
    return chain


def _block_bytes() -> int:
    return (2 * LAYERS * HEADS * HEAD_DIM + VOCAB) * BLOCK_TOKENS * 4


def test_a_hit_covers_whole_blocks_and_leaves_at_least_two_tokens_to_compute():
    assert [usable_tokens(n) for n in (0, 1, 17, 18, 33, 34, 35, 50)] == [0, 0, 0, 16, 16, 32, 32, 48]
    assert all(n - usable_tokens(n) >= MIN_SUFFIX_TOKENS for n in range(2, 300))


def test_blocks_are_found_by_their_tokens_and_every_token_before_them():
    cache = PrefixCache(BUDGET)
    prompt = list(range(3 * BLOCK_TOKENS + 5))
    kv, logits = _pass(1, len(prompt), seed=0)
    cache.insert(prompt, kv, logits, row=0)
    assert len(cache) == 3 and cache.stats.bytes == 3 * _block_bytes()
    chain = matched(cache, prompt)
    assert len(chain) == 3
    np.testing.assert_array_equal(chain[1].kv, np.stack([k[0, :, BLOCK_TOKENS : 2 * BLOCK_TOKENS] for k in kv]))
    np.testing.assert_array_equal(chain[2].logits, logits[2 * BLOCK_TOKENS : 3 * BLOCK_TOKENS])
    # the same second block after another first one is another block: not found
    other = [99, *prompt[1:]]
    assert matched(cache, other) == []
    # a prompt that ends inside the third block (or leaves fewer than two tokens after it) hits two
    assert len(matched(cache, prompt[: 3 * BLOCK_TOKENS + 1])) == 2
    assert len(matched(cache, prompt[: 3 * BLOCK_TOKENS + 2])) == 3
    assert cache.stats.queried_tokens == 2 * len(prompt) + 2 * 3 * BLOCK_TOKENS + 3
    assert cache.stats.hit_tokens == (3 + 2 + 3) * BLOCK_TOKENS


def test_inserting_after_a_hit_takes_the_pass_logits_from_the_hits_end():
    cache = PrefixCache(BUDGET)
    prompt = list(range(2 * BLOCK_TOKENS + 3))
    kv, logits = _pass(1, len(prompt), seed=1)
    cache.insert(prompt[:BLOCK_TOKENS + 3], kv, logits, row=0)
    known = matched(cache, prompt)
    assert len(known) == 1
    # the pass over the rest: its logits start at position BLOCK_TOKENS; its presents hold every slot
    cache.insert(prompt, kv, logits[BLOCK_TOKENS:], row=0, start_block=1, known=known)
    second = matched(cache, prompt + [0])[1]
    np.testing.assert_array_equal(second.logits, logits[BLOCK_TOKENS : 2 * BLOCK_TOKENS])
    np.testing.assert_array_equal(second.kv[0], kv[0][0, :, BLOCK_TOKENS : 2 * BLOCK_TOKENS])


def test_the_budget_evicts_the_least_recently_used_leaves_first():
    cache = PrefixCache(4 * _block_bytes())
    first = list(range(3 * BLOCK_TOKENS))
    second = [1000 + t for t in range(2 * BLOCK_TOKENS)]
    cache.insert(first, *_pass(1, len(first), seed=2), row=0)
    cache.insert(second, *_pass(1, len(second), seed=3), row=0)  # 5 blocks > 4: first's last block goes
    assert cache.stats.evicted_blocks == 1 and len(cache) == 4 and cache.stats.bytes == 4 * _block_bytes()
    assert len(matched(cache, first + [0, 0])) == 2
    # first's two blocks are now the most recent: a new block evicts second's leaf, then its root
    third = [2000 + t for t in range(2 * BLOCK_TOKENS)]
    cache.insert(third, *_pass(1, len(third), seed=4), row=0)
    assert len(matched(cache, second + [0, 0])) == 0
    assert len(matched(cache, first + [0, 0])) == 2 and len(matched(cache, third + [0, 0])) == 2
    cache.clear()
    assert len(cache) == 0 and cache.stats.bytes == 0 and cache.stats.evicted_blocks == 3 + 4
    with pytest.raises(ValueError, match="positive budget"):
        PrefixCache(0)
    assert len(PrefixCache(1)) == 0


def test_pinned_blocks_stay_until_released_and_a_full_pool_of_pinned_blocks_keeps_nothing_new():
    cache = PrefixCache(2 * _block_bytes())
    first = list(range(2 * BLOCK_TOKENS + 2))
    cache.insert(first, *_pass(1, len(first), seed=10), row=0)
    chain = cache.match(first)  # pinned, as a prefill holds it
    kv = chain[1].kv.copy()
    second = [500 + t for t in range(2 * BLOCK_TOKENS)]
    cache.insert(second, *_pass(1, len(second), seed=11), row=0)
    assert len(cache) == 2 and cache.stats.evicted_blocks == 0 and matched(cache, second + [0, 0]) == []
    np.testing.assert_array_equal(chain[1].kv, kv)  # its slot was not reused
    cache.release([chain])
    cache.insert(second, *_pass(1, len(second), seed=11), row=0)
    assert len(matched(cache, second + [0, 0])) == 2 and matched(cache, first) == []
    assert cache.stats.evicted_blocks == 2 and cache.stats.bytes == 2 * _block_bytes()


def test_a_prompt_inserted_again_adds_nothing_and_any_int_array_finds_its_blocks():
    cache = PrefixCache(BUDGET)
    prompt = list(range(2 * BLOCK_TOKENS + 2))
    cache.insert(prompt, *_pass(1, len(prompt), seed=5), row=0)
    first = matched(cache, prompt)
    cache.insert(prompt, *_pass(1, len(prompt), seed=6), row=0)
    assert len(cache) == 2 and cache.stats.bytes == 2 * _block_bytes()
    assert [b.id for b in matched(cache, np.array(prompt, dtype=np.int32))] == [b.id for b in first]
    np.testing.assert_array_equal(matched(cache, prompt)[1].kv, first[1].kv)  # the first pass's, kept


def test_a_block_follows_only_its_own_parent():
    cache = PrefixCache(BUDGET)
    a, b, x, y = ([t] * BLOCK_TOKENS for t in (1, 2, 3, 4))
    cache.insert(a + x, *_pass(1, 2 * BLOCK_TOKENS, seed=7), row=0)
    cache.insert(b + y, *_pass(1, 2 * BLOCK_TOKENS, seed=8), row=0)
    assert len(matched(cache, b + x + [0, 0])) == 1
    assert len(matched(cache, a + x + [0, 0])) == 2
    assert len({block.id for block in matched(cache, a + x + [0, 0]) + matched(cache, b + y + [0, 0])}) == 4


def test_the_past_of_several_chains_is_each_rows_blocks_in_order():
    cache = PrefixCache(BUDGET)
    prompts = [list(range(1, 2 * BLOCK_TOKENS + 3)), list(range(100, 100 + 2 * BLOCK_TOKENS + 3))]
    kv, logits = _pass(2, 2 * BLOCK_TOKENS + 2, seed=9)
    for row, prompt in enumerate(prompts):
        cache.insert(prompt, kv, logits, row=row)
    past = past_of([matched(cache, p) for p in prompts])
    assert len(past) == 2 * LAYERS
    for got, want in zip(past, kv):
        assert got.dtype == np.float32 and got.flags.c_contiguous
        np.testing.assert_array_equal(got, want[:, :, : 2 * BLOCK_TOKENS])
    np.testing.assert_array_equal(logits_of(matched(cache, prompts[0])), logits[: 2 * BLOCK_TOKENS])


@pytest.fixture(scope="module")
def released():
    return ModelRepository(RELEASE_REPOSITORY).get("gpt")


def _prompts(engine: GPTEngine, rng: np.random.Generator, batch: int) -> list[list[int]]:
    """Prompts that share prefixes of every length with each other (and with earlier batches), and some that
    share none."""
    shared = engine.tokenizer.encode(SHAKESPEARE).ids
    prompts = []
    for _ in range(batch):
        tail = engine.tokenizer.encode(TAILS[int(rng.integers(len(TAILS)))]).ids
        head = shared[: int(rng.integers(len(shared)))] if rng.random() < 0.8 else []
        prompts.append(((head + tail) or [int(rng.integers(1, 200))])[: engine.context_length - STEPS])
    return prompts


@pytest.mark.slow
@pytest.mark.parametrize("variant", [None, "fp32", "fp32+gqa+kv8"])
def test_a_prompt_pass_from_cached_blocks_gives_the_numbers_of_one_without(released, variant):
    on = GPTEngine(released, RuntimeOptions(weights=variant, prefix_cache_bytes=BUDGET))
    off = GPTEngine(released, RuntimeOptions(weights=variant))
    assert on.prefix_caching["enabled"] and off.prefix_cache is None
    on.reserve_prefix_cache()
    off.reserve_prefix_cache()  # nothing to reserve
    assert on.prefix_cache.stats.bytes == 0 and len(on.prefix_cache) == 0
    assert off.prefix_caching["reason"] == "turned off (TSERVE_PREFIX_CACHE)"
    rng = np.random.default_rng(55)
    hit_rows = 0
    for _ in range(12):
        prompts = _prompts(on, rng, int(rng.integers(1, 6)))
        rows = range(len(prompts))
        got, want = on.prefill_cached(prompts, rows), off.prefill_cached(prompts, rows)
        assert want.cached_tokens == [0] * len(prompts)
        assert all(c == 0 or (c % BLOCK_TOKENS == 0 and len(p) - c >= MIN_SUFFIX_TOKENS)
                   for c, p in zip(got.cached_tokens, prompts))
        hit_rows += sum(c > 0 for c in got.cached_tokens)
        np.testing.assert_array_equal(got.logits, want.logits)
        for row in rows:
            np.testing.assert_array_equal(got.every[row], want.every[row])
        a, b = got.cache, want.cache
        np.testing.assert_array_equal(a.mask, b.mask)
        np.testing.assert_array_equal(a.positions, b.positions)
        for row, prompt in enumerate(prompts):
            for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)):
                np.testing.assert_array_equal(x[row, :, : len(prompt)], y[row, :, : len(prompt)])
        tokens = got.logits.argmax(-1)
        for _ in range(STEPS):
            stepped, reference = on.step(a, tokens), off.step(b, tokens)
            np.testing.assert_array_equal(stepped, reference)
            tokens = reference.argmax(-1)
    assert hit_rows >= 10, "the prompts were meant to hit"
    assert 0 < on.prefix_cache.stats.bytes <= BUDGET


def test_a_host_whose_suffix_pass_differs_keeps_no_cache(released, monkeypatch):
    engine = GPTEngine(released, RuntimeOptions(prefix_cache_bytes=BUDGET))
    assert suffix_exact(engine._prompt_pass, engine.vocab_size, engine.context_length) is None

    def drifting(prompts, past=None):  # a pass after cached K/V that rounds differently
        logits, presents = engine._prompt_pass(prompts, past)
        return (logits if past is None else logits + np.float32(1e-6)), presents

    reason = suffix_exact(drifting, engine.vocab_size, engine.context_length)
    assert reason is not None and "suffix" in reason and "differs" in reason
    monkeypatch.setattr("service.engines.gpt.suffix_exact", lambda *args: reason)
    off = GPTEngine(released, RuntimeOptions(prefix_cache_bytes=BUDGET))
    assert off.prefix_cache is None and off.prefix_caching == {
        "enabled": False, "block_tokens": BLOCK_TOKENS, "budget_bytes": BUDGET, "reason": reason}
    assert off.prefill_cached([list(range(1, 40))]).cached_tokens == [0]


def test_a_block_pinned_twice_stays_until_both_release_it():
    cache = PrefixCache(2 * _block_bytes())
    first = list(range(BLOCK_TOKENS + 2))
    cache.insert(first, *_pass(1, len(first), seed=12), row=0)
    held, again = cache.match(first), cache.match(first)
    cache.insert(first, *_pass(1, len(first), seed=12), row=0)  # inserting it again keeps its pins
    cache.release([again])
    other = [[300 + t] * BLOCK_TOKENS for t in range(2)]
    cache.insert(other[0] + other[1], *_pass(1, 2 * BLOCK_TOKENS, seed=13), row=0)  # 2 slots: one is pinned
    assert matched(cache, first) == held and held[0].logits.dtype == np.float32
    assert len(matched(cache, other[0] + other[1] + [0, 0])) == 1
    cache.release([held])
    cache.insert(other[0] + other[1], *_pass(1, 2 * BLOCK_TOKENS, seed=13), row=0)
    assert matched(cache, first) == [] and len(matched(cache, other[0] + other[1] + [0, 0])) == 2


def test_a_pool_full_of_pinned_blocks_keeps_the_blocks_it_could_with_their_numbers():
    cache = PrefixCache(3 * _block_bytes())
    a = [7] * BLOCK_TOKENS
    cache.insert(a, *_pass(1, BLOCK_TOKENS, seed=14), row=0)
    pinned = cache.match(a + [0, 0])
    b = list(range(100, 100 + 3 * BLOCK_TOKENS))
    kv, logits = _pass(1, len(b), seed=15)
    cache.insert(b, kv, logits, row=0)  # 2 free slots, then only pinned blocks
    cache.release([pinned])
    chain = matched(cache, b + [0, 0])
    assert len(chain) == 2 and len(cache) == 3
    np.testing.assert_array_equal(chain[1].kv, np.stack([k[0, :, BLOCK_TOKENS : 2 * BLOCK_TOKENS] for k in kv]))
    cache.insert(b, kv, logits, row=0)  # nothing pinned now: the third block evicts a's
    assert len(matched(cache, b + [0, 0])) == 3 and matched(cache, a + [0, 0]) == []


def test_a_reserved_pool_holds_the_budget_in_whole_blocks_of_the_models_shapes():
    cache = PrefixCache(5 * _block_bytes() + 7)
    assert cache.capacity == 0
    cache.reserve(LAYERS, HEADS, HEAD_DIM, VOCAB)
    assert cache.capacity == 5
    cache.reserve(LAYERS + 1, HEADS, HEAD_DIM, VOCAB)  # once made, the pool stays
    prompt = list(range(7 * BLOCK_TOKENS))
    cache.insert(prompt, *_pass(1, len(prompt), seed=17), row=0)
    # its first five blocks: the sixth finds only the chain being kept, pinned while it is
    assert len(cache) == 5 and cache.stats.bytes == 5 * _block_bytes() and cache.stats.evicted_blocks == 0
    chain = matched(cache, prompt)
    assert chain[0].kv.shape == (2 * LAYERS, HEADS, BLOCK_TOKENS, HEAD_DIM) and chain[0].kv.dtype == np.float32
    assert past_of([chain])[0].dtype == np.float32


def test_a_cleared_cache_takes_blocks_again():
    cache = PrefixCache(2 * _block_bytes())
    prompt = list(range(2 * BLOCK_TOKENS + 2))
    kv, logits = _pass(1, len(prompt), seed=16)
    cache.insert(prompt, kv, logits, row=0)
    cache.clear()
    cache.insert(prompt, kv, logits, row=0)
    chain = matched(cache, prompt)
    assert len(chain) == 2 and {block.slot for block in chain} == {0, 1}
    np.testing.assert_array_equal(logits_of(chain), logits[: 2 * BLOCK_TOKENS])
