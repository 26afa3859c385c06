"""The prompt pass over a prefix cache (`service.engines.prefix_pass`) on a fake model whose pass is exact by
construction (each slot's K/V is its token and position; a position's logits sum the K/V of the slots up to it): a
prefill from cached blocks equals one without a cache in every output (next-token logits, the logits at every
position of the rows asked for, the presents of every used slot laid out as one whole pass, the mask and lengths),
for batches mixing misses and hits of several lengths; and the load-time check (`suffix_exact`) tells a pass that
differs after a cached prefix, at which suffix, from one that does not.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.engines.prefix_cache import BLOCK_TOKENS, MIN_SUFFIX_TOKENS, PrefixCache, usable_tokens
from service.engines.prefix_pass import CHECK_SPLITS, prefill_with_cache, suffix_exact

VOCAB, LAYERS = 7, 2
CONTEXT = 96


class FakeModel:
    """`PromptPass`: slot t of row r holds (token, position, layer) in every layer's keys and values (x2 for the
    values); position p's logits are the sums of the keys of slots 0..p times (1..V). Padding slots get the pad
    token 0 at position 0, as the engine feeds them."""

    def __init__(self):
        self.calls: list[tuple[int, int, int]] = []  # (rows, past slots, new slots) per pass

    def __call__(self, prompts, past=None):
        rows, longest = len(prompts), max(len(p) for p in prompts)
        start = 0 if past is None else past[0].shape[2]
        self.calls.append((rows, start, longest))
        new = np.zeros((rows, 1, longest, 3), np.float32)
        for r, prompt in enumerate(prompts):
            new[r, 0, : len(prompt), 0] = prompt
            new[r, 0, : len(prompt), 1] = np.arange(start, start + len(prompt))
        presents = []
        for layer in range(LAYERS):
            keys = new.copy()
            keys[..., 2] = layer
            for values, kind in ((keys, 1), (keys * 2, 2)):
                old = past[2 * layer + kind - 1] if past is not None else np.zeros((rows, 1, 0, 3), np.float32)
                presents.append(np.concatenate([old, values], axis=2))
        summed = np.cumsum(presents[0][:, 0, :, :2].sum(-1), axis=1)[:, start:]  # (rows, longest)
        logits = summed[..., None] * np.arange(1, VOCAB + 1, dtype=np.float32)
        return logits.astype(np.float32), presents


def _prompts(rng: np.random.Generator, shared: list[int], batch: int) -> list[list[int]]:
    out = []
    for _ in range(batch):
        head = shared[: int(rng.integers(0, len(shared) + 1))]
        tail = rng.integers(1, VOCAB, int(rng.integers(1, 20))).tolist()
        out.append((head + tail)[:CONTEXT])
    return out


def test_a_prefill_from_cached_blocks_equals_one_without_a_cache():
    rng = np.random.default_rng(0)
    shared = rng.integers(1, VOCAB, 70).tolist()
    model, cache = FakeModel(), PrefixCache(1 << 30)
    hits = set()
    for _ in range(20):
        prompts = _prompts(rng, shared, int(rng.integers(1, 6)))
        rows = [r for r in range(len(prompts)) if rng.random() < 0.5]
        got = prefill_with_cache(prompts, rows, model, cache)
        want = prefill_with_cache(prompts, rows, FakeModel(), PrefixCache(1 << 30))  # a fresh cache: every row misses
        assert want.cached_tokens == [0] * len(prompts)
        assert all(c % BLOCK_TOKENS == 0 and c <= usable_tokens(len(p)) for p, c in zip(prompts, got.cached_tokens))
        hits |= {c for c in got.cached_tokens if c}
        np.testing.assert_array_equal(got.last, want.last)
        np.testing.assert_array_equal(got.last, [FakeModel()([p])[0][0, -1] for p in prompts])
        assert got.last.dtype == np.float32 and got.mask.dtype == got.lengths.dtype == np.int64
        assert all(p.dtype == np.float32 for p in got.presents)
        assert sorted(got.every) == sorted(want.every) == sorted(rows)
        for row in rows:
            np.testing.assert_array_equal(got.every[row], want.every[row])
        np.testing.assert_array_equal(got.mask, want.mask)
        np.testing.assert_array_equal(got.lengths, [len(p) for p in prompts])
        assert len(got.presents) == 2 * LAYERS
        for a, b in zip(got.presents, want.presents):
            assert a.shape == b.shape == (len(prompts), 1, max(map(len, prompts)), 3)
            np.testing.assert_array_equal(a * got.mask[:, None, :, None], b * want.mask[:, None, :, None])
    assert len(hits) >= 3, f"hits of several lengths were meant to occur: {hits}"


def test_rows_that_hit_as_many_blocks_share_one_pass_over_their_suffixes():
    rng = np.random.default_rng(1)
    shared = rng.integers(1, VOCAB, 3 * BLOCK_TOKENS).tolist()
    model, cache = FakeModel(), PrefixCache(1 << 30)
    prefill_with_cache([shared + [1, 2]], [], model, cache)  # caches 3 blocks
    assert model.calls == [(1, 0, 3 * BLOCK_TOKENS + 2)]
    model.calls.clear()
    prompts = [shared[:BLOCK_TOKENS] + [3, 3, 3], rng.integers(1, VOCAB, 5).tolist(), shared + [4, 4],
               shared[: 2 * BLOCK_TOKENS] + [5, 5], shared[:BLOCK_TOKENS] + [6, 6], shared[:BLOCK_TOKENS + 1]]
    got = prefill_with_cache(prompts, [0], model, cache)
    assert got.cached_tokens == [16, 0, 48, 32, 16, 0]
    # misses first (with the one whose suffix would be a single token), then one pass per hit length
    assert model.calls == [(2, 0, BLOCK_TOKENS + 1), (2, BLOCK_TOKENS, 3), (1, 2 * BLOCK_TOKENS, 2),
                           (1, 3 * BLOCK_TOKENS, 2)]
    np.testing.assert_array_equal(got.every[0], FakeModel()([prompts[0]])[0][0])


def test_a_single_pass_in_order_keeps_its_presents_and_the_mask_marks_each_rows_slots():
    model, cache = FakeModel(), PrefixCache(1 << 30)
    prompts = [[1, 2, 3], [4, 5]]
    got = prefill_with_cache(prompts, [], model, cache)
    _, presents = FakeModel()(prompts)
    for a, b in zip(got.presents, presents):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got.mask, [[1, 1, 1], [1, 1, 0]])
    assert got.every == {} and len(cache) == 0


def test_the_load_check_passes_an_exact_pass_and_names_the_suffix_where_one_differs():
    assert suffix_exact(FakeModel(), VOCAB, CONTEXT) is None
    exact = FakeModel()

    def drifting_after(blocks: int):
        def run(prompts, past=None):
            logits, presents = exact(prompts, past)
            if past is not None and past[0].shape[2] == blocks * BLOCK_TOKENS:
                presents = [p.copy() for p in presents]
                presents[-1][1, 0, -1, 0] += 1e-3  # the last K/V slot of the longer row
            return logits, presents
        return run

    for blocks, suffix in CHECK_SPLITS:
        reason = suffix_exact(drifting_after(blocks), VOCAB, CONTEXT)
        assert reason is not None and f"{suffix}-token suffix after {blocks * BLOCK_TOKENS} cached tokens" in reason
        assert "1e-03" in reason or "0.001" in reason

    def logits_drift(prompts, past=None):
        logits, presents = exact(prompts, past)
        return (logits if past is None else np.nextafter(logits, np.inf)), presents

    assert "differs" in suffix_exact(logits_drift, VOCAB, CONTEXT)

    def first_row_drift(prompts, past=None):  # the shorter row only
        logits, presents = exact(prompts, past)
        if past is not None:
            logits = logits.copy()
            logits[0, 0, 0] += 1
        return logits, presents

    assert "max |difference| 1" in suffix_exact(first_row_drift, VOCAB, CONTEXT)
    # a context too short for a split is not checked there; one that just fits it is
    blocks, suffix = CHECK_SPLITS[1]
    assert suffix_exact(drifting_after(blocks), VOCAB, blocks * BLOCK_TOKENS + suffix) is None
    assert suffix_exact(drifting_after(blocks), VOCAB, blocks * BLOCK_TOKENS + suffix + 1) is not None


def test_the_load_check_runs_real_tokens_of_two_lengths():
    seen = []

    def recording(prompts, past=None):
        seen.append([list(p) for p in prompts])
        return FakeModel()(prompts, past)

    assert suffix_exact(recording, VOCAB, CONTEXT) is None
    wholes = seen[0::3]
    assert [[len(p) for p in whole] for whole in wholes] == [
        [b * BLOCK_TOKENS + s, b * BLOCK_TOKENS + s + 1] for b, s in CHECK_SPLITS]
    tokens = {t for whole in wholes for p in whole for t in p}
    assert min(tokens) >= 1 and max(tokens) < VOCAB and len(tokens) > 2
    assert MIN_SUFFIX_TOKENS == CHECK_SPLITS[0][1]


@pytest.mark.parametrize("length", [1, 2, BLOCK_TOKENS + 1, BLOCK_TOKENS + 2, 3 * BLOCK_TOKENS])
def test_a_prompt_leaves_at_least_two_tokens_to_compute_after_its_hit(length):
    model, cache = FakeModel(), PrefixCache(1 << 30)
    prompt = list(range(1, length + 1))
    prefill_with_cache([prompt + [9] * 40], [], model, cache)
    got = prefill_with_cache([prompt], [0], model, cache)
    assert got.cached_tokens == [usable_tokens(length)]
    assert length - got.cached_tokens[0] >= min(length, MIN_SUFFIX_TOKENS)
    np.testing.assert_array_equal(got.every[0], FakeModel()([prompt])[0][0])
