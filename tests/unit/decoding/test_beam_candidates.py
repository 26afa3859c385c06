"""A beam step looks at a few blocks of the vocabulary, not at every (row, token) pair: the candidates it finds
must be exactly those of a top-k over the whole candidate array (the reference below, which is what the search
did before the blocks), ties, masked tokens and vocabularies that the block does not divide included."""

from __future__ import annotations

import numpy as np
import pytest

from service.decoding import BeamSearch, step_searches
from service.decoding.beam_candidates import CANDIDATE_BLOCK, search_candidates, top_candidates, top_k_rows
from service.decoding.distributions import block_maxima, log_normaliser, log_softmax, top_k_indices


def reference_candidates(scores: np.ndarray, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k over every (row, token): accumulated score + log-softmax, ties by lower flat index."""
    cand = (scores[:, None] + log_softmax(x)).ravel()
    top = top_k_indices(cand, k)
    return top, cand[top]


def candidates_k(num_beams: int) -> int:
    return BeamSearch(num_beams=num_beams, max_new_tokens=50, eos_token_id=0).candidates


def logits_for(rng: np.random.Generator, shape: tuple[int, int], trial: int, dtype) -> np.ndarray:
    x = (rng.standard_normal(shape) * 4).astype(dtype)
    if trial % 4 == 1:  # coarse logits: many exact ties, within and across rows
        x = np.round(x).astype(dtype)
    if trial % 4 == 2:  # masked tokens (n-gram bans, min_new_tokens) are -inf
        x[rng.random(x.shape) < 0.3] = -np.inf
    if trial % 4 == 3:  # one row fully masked but a few tokens
        x[0] = -np.inf
        x[0, rng.integers(0, shape[1], 2)] = 1.0
    return x


@pytest.mark.parametrize("vocab", [7, 64, 65, 257, 1000, 8000])
@pytest.mark.parametrize("num_beams", [1, 2, 4, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_candidates_are_the_whole_arrays_top_k(vocab, num_beams, dtype):
    rng = np.random.default_rng(vocab * 31 + num_beams)
    k = candidates_k(num_beams)
    for trial in range(20):
        x = logits_for(rng, (num_beams, vocab), trial, dtype)
        scores = np.round(rng.standard_normal(num_beams) * 2, 1) if trial % 2 else -rng.random(num_beams) * 10
        top, top_scores = search_candidates(x, *log_normaliser(x), scores, k)
        expected, expected_scores = reference_candidates(scores, x, k)
        np.testing.assert_array_equal(top, expected)
        np.testing.assert_array_equal(top_scores, expected_scores)  # bit for bit: the same float64 operations


@pytest.mark.parametrize("vocab", [65, 1000])
def test_the_searches_of_a_step_found_together_are_each_found_alone(vocab):
    """S searches of R rows in one `top_candidates` call, their rows anywhere in the step's array."""
    rng = np.random.default_rng(vocab)
    for trial in range(12):
        searches, rows = 5, 3
        x = logits_for(rng, (searches * rows + 2, vocab), trial, np.float32)
        peak, log_z = log_normaliser(x)
        scores = np.round(rng.standard_normal((searches, rows)), 1) if trial % 2 else -rng.random((searches, rows))
        starts = np.array([2, 5, 8, 11, 14])  # rows 0-1 belong to no search of this group
        tops, top_scores = top_candidates(x, peak, log_z, block_maxima(x, CANDIDATE_BLOCK), scores, starts, 7)
        for s, start in enumerate(starts):
            expected, expected_scores = reference_candidates(scores[s], x[start : start + rows], 7)
            np.testing.assert_array_equal(tops[s], expected)
            np.testing.assert_array_equal(top_scores[s], expected_scores)


def test_top_k_rows_is_top_k_indices_per_row_with_ties_by_key():
    rng = np.random.default_rng(5)
    values = np.round(rng.standard_normal((40, 30)))  # ties everywhere, at the k-th value too
    for k in (1, 4, 29, 30, 31):
        expected = np.stack([top_k_indices(row, k) for row in values])
        np.testing.assert_array_equal(top_k_rows(values, k), expected)
    keys = np.broadcast_to(np.arange(30)[::-1], values.shape)  # ties by higher column now
    flipped = np.stack([29 - top_k_indices(row[::-1], 5) for row in values])
    np.testing.assert_array_equal(top_k_rows(values, 5, keys), flipped)


def test_batched_beam_steps_match_each_search_stepped_alone():
    """`step_searches` finds the candidates of equal-shaped beam searches together: every result is the one the
    search gives stepped alone, over several steps (beams of 2 and 3, one with n-gram bans)."""
    rng = np.random.default_rng(11)
    make = [lambda: BeamSearch(2, 6, 0), lambda: BeamSearch(3, 6, 0, no_repeat_ngram_size=2),
            lambda: BeamSearch(2, 6, 0, min_new_tokens=3), lambda: BeamSearch(3, 6, 0)]
    together, alone = [m() for m in make], [m() for m in make]
    for _ in range(5):
        active = [i for i, s in enumerate(together) if not s.done]
        if not active:
            break
        logits = np.round(rng.standard_normal((sum(together[i].num_rows for i in active), 70)), 1)
        logits = logits.astype(np.float32)
        results = step_searches([together[i] for i in active], logits)
        offset = 0
        for i, result in zip(active, results):
            rows = logits[offset : offset + alone[i].num_rows]
            offset += alone[i].num_rows
            single = alone[i].step(rows)
            assert result.done == single.done
            np.testing.assert_array_equal(result.tokens, single.tokens)
            np.testing.assert_array_equal(result.parents, single.parents)
    for a, b in zip(together, alone):
        assert a.done == b.done
        if a.done:
            assert [(h.tokens, h.score) for h in a.results()] == [(h.tokens, h.score) for h in b.results()]


def test_candidates_when_the_rows_hold_fewer_entries_than_k():
    x = np.array([[0.5, 0.1, 0.9]], dtype=np.float32)
    top, top_scores = search_candidates(x, *log_normaliser(x), np.zeros(1), candidates_k(4))
    expected, expected_scores = reference_candidates(np.zeros(1), x, candidates_k(4))
    np.testing.assert_array_equal(top, expected)
    np.testing.assert_array_equal(top_scores, expected_scores)
    assert top.tolist() == [2, 0, 1]


def test_log_normaliser_of_float32_logits_is_log_softmax_bit_for_bit():
    x = (np.random.default_rng(3).standard_normal((6, 1001)) * 5).astype(np.float32)
    x[2, :500] = -np.inf
    peak, log_z = log_normaliser(x)
    np.testing.assert_array_equal((x.astype(np.float64) - peak[:, None]) - log_z[:, None], log_softmax(x))


@pytest.mark.parametrize("vocab", [1, 63, 64, 130])
def test_block_maxima_cover_every_entry_once(vocab):
    x = np.random.default_rng(vocab).standard_normal((3, vocab))
    maxima = block_maxima(x, CANDIDATE_BLOCK)
    starts = range(0, vocab, CANDIDATE_BLOCK)
    expected = np.stack([[row[s : s + CANDIDATE_BLOCK].max() for s in starts] for row in x])
    np.testing.assert_array_equal(maxima, expected)
