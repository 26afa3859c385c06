"""A beam step looks at a few blocks of the vocabulary, not at every (row, token) pair: the candidates it finds
must be exactly those of a top-k over the whole candidate array (the reference below, which is what the search
did before the blocks), ties, masked tokens and vocabularies that the block does not divide included."""

from __future__ import annotations

import numpy as np
import pytest

from service.decoding import BeamSearch
from service.decoding.beam import _CANDIDATE_BLOCK
from service.decoding.distributions import block_maxima, log_normaliser, log_softmax, top_k_indices


def reference_candidates(scores: np.ndarray, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k over every (row, token): accumulated score + log-softmax, ties by lower flat index."""
    cand = (scores[:, None] + log_softmax(x)).ravel()
    top = top_k_indices(cand, k)
    return top, cand[top]


def search_with_rows(num_beams: int, rows: int, scores: np.ndarray) -> BeamSearch:
    search = BeamSearch(num_beams=num_beams, max_new_tokens=50, eos_token_id=0)
    search._rows, search._scores = rows, scores  # a search part-way through, `rows` beams running
    return search


@pytest.mark.parametrize("vocab", [7, 64, 65, 257, 1000, 8000])
@pytest.mark.parametrize("num_beams", [1, 2, 4, 5])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_candidates_are_the_whole_arrays_top_k(vocab, num_beams, dtype):
    rng = np.random.default_rng(vocab * 31 + num_beams)
    for trial in range(20):
        x = (rng.standard_normal((num_beams, vocab)) * 4).astype(dtype)
        if trial % 4 == 1:  # coarse logits: many exact ties, within and across rows
            x = np.round(x).astype(dtype)
        if trial % 4 == 2:  # masked tokens (n-gram bans, min_new_tokens) are -inf
            x[rng.random(x.shape) < 0.3] = -np.inf
        if trial % 4 == 3:  # one row fully masked but a few tokens
            x[0] = -np.inf
            x[0, rng.integers(0, vocab, 2)] = 1.0
        scores = np.round(rng.standard_normal(num_beams) * 2, 1) if trial % 2 else -rng.random(num_beams) * 10
        search = search_with_rows(num_beams, num_beams, scores.astype(np.float64))
        peak, log_z = log_normaliser(x)
        top, top_scores = search._top_candidates(x, peak, log_z)
        expected, expected_scores = reference_candidates(search._scores, x, search._k)
        np.testing.assert_array_equal(top, expected)
        np.testing.assert_array_equal(top_scores, expected_scores)  # bit for bit: the same float64 operations


def test_candidates_when_the_rows_hold_fewer_entries_than_k():
    x = np.array([[0.5, 0.1, 0.9]], dtype=np.float32)
    search = search_with_rows(num_beams=4, rows=1, scores=np.zeros(1))
    top, top_scores = search._top_candidates(x, *log_normaliser(x))
    expected, expected_scores = reference_candidates(search._scores, x, search._k)
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
    maxima = block_maxima(x, _CANDIDATE_BLOCK)
    starts = range(0, vocab, _CANDIDATE_BLOCK)
    expected = np.stack([[row[s : s + _CANDIDATE_BLOCK].max() for s in starts] for row in x])
    np.testing.assert_array_equal(maxima, expected)
