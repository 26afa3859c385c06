"""Beam searches stepped on each row's most likely tokens (`StepLogits`, what the translator's graph computes:
`service.engines.row_candidates`) choose exactly what a top-K over every (row, token) entry of the same
log-probabilities chooses, with ties, n-gram bans and min_new_tokens masks; a search that needs more tokens per
row than the step holds reads the whole logits instead."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from service.decoding import BeamSearch, GreedySearch, step_searches
from service.decoding.distributions import log_softmax, top_k_indices
from service.decoding.types import StepLogits, row_candidates

VOCAB = 300
STEPS = 12


def step_logits(x: np.ndarray, k: int) -> StepLogits:
    """What the graph hands over: float32 log-softmax, each row's k best, ties by lower id."""
    logprobs = log_softmax(x).astype(np.float32)
    ids = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]
    return StepLogits(x, np.take_along_axis(logprobs, ids, axis=-1), ids)


def expected_step(search: BeamSearch, x: np.ndarray, logprobs: np.ndarray):
    """A copy of ``search`` advanced on the top-K over every entry of ``logprobs`` (float32, (rows, V)) where its
    processors leave the logits ``x`` (rows, V) unmasked (`BeamSearch.mask`, the whole-logits path's)."""
    search = copy.deepcopy(search)
    masked = x.copy()
    search.mask(masked)
    lp = np.where(np.isneginf(masked), -np.inf, logprobs.astype(np.float64))
    cand = (search.beam_scores[:, None] + lp).ravel()
    top = top_k_indices(cand, search.candidates)
    return search.advance(top, cand[top], lp.shape[1]), search


def make_searches(rng: np.random.Generator) -> list:
    return [BeamSearch(4, STEPS, eos_token_id=2, length_penalty=1.2),
            BeamSearch(2, STEPS, eos_token_id=[2, 3], no_repeat_ngram_size=2, prefix=[1]),
            GreedySearch(STEPS, eos_token_id=2),
            BeamSearch(3, STEPS, eos_token_id=2, min_new_tokens=4, early_stopping=True),
            BeamSearch(4, STEPS, eos_token_id=2, no_repeat_ngram_size=1, num_return_sequences=2)]


@pytest.mark.parametrize("coarse", [False, True], ids=["distinct", "ties"])
def test_beams_on_the_rows_best_tokens_choose_as_a_top_k_over_every_entry(coarse):
    rng = np.random.default_rng(7 + coarse)
    searches = make_searches(rng)
    for _ in range(STEPS):
        active = [s for s in searches if not s.done]
        if not active:
            break
        x = (rng.standard_normal((sum(s.num_rows for s in active), VOCAB)) * 3).astype(np.float32)
        x[:, [2, 3]] -= 2.0  # EOS less likely: the searches run for several steps
        if coarse:  # many exact ties within and across rows
            x = np.round(x)
        step = step_logits(x, row_candidates(active))
        logprobs = log_softmax(x).astype(np.float32)
        expected, start = [], 0
        for s in active:
            if isinstance(s, BeamSearch):
                rows = slice(start, start + s.num_rows)
                expected.append(expected_step(s, x[rows], logprobs[rows]))
            else:
                expected.append(None)
            start += s.num_rows
        results = step_searches(active, step)
        for search, result, want in zip(active, results, expected):
            if want is None:
                continue
            want_result, want_search = want
            np.testing.assert_array_equal(result.tokens, want_result.tokens)
            np.testing.assert_array_equal(result.parents, want_result.parents)
            assert result.done == want_result.done
            np.testing.assert_array_equal(search.beam_scores, want_search.beam_scores)
    for search in searches:
        assert search.done


def test_the_candidates_cover_the_banned_tokens():
    """A row whose best tokens are banned still gets K unbanned candidates: a search asks for K plus its bans."""
    search = BeamSearch(2, 10, eos_token_id=2, no_repeat_ngram_size=1, prefix=[5, 6, 7])
    assert search.row_candidates == search.candidates + 3  # 5, 6 and 7 are banned at the first step
    x = np.zeros((1, VOCAB), np.float32)
    x[0, [5, 6, 7]] = 10.0  # the banned tokens are the most likely
    x[0, [40, 41, 42, 43]] = 5.0
    (result,) = step_searches([search], step_logits(x, search.row_candidates))
    assert sorted(result.tokens.tolist()) == [40, 41]
    short = BeamSearch(1, 10, eos_token_id=2, min_new_tokens=2, early_stopping=True)  # done at its first EOS
    assert short.row_candidates == short.candidates + 1  # EOS, banned until two tokens are generated
    x[0, 2] = 20.0  # EOS the most likely
    (result,) = step_searches([short], step_logits(x, short.row_candidates))
    assert result.tokens.tolist() == [5] and not short.done


def test_a_search_that_needs_more_tokens_than_the_step_holds_reads_the_logits():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((1, VOCAB)) * 3).astype(np.float32)
    on_logits, on_few = BeamSearch(4, 10, eos_token_id=2), BeamSearch(4, 10, eos_token_id=2)
    (expected,) = step_searches([on_logits], x)
    (result,) = step_searches([on_few], step_logits(x, 1))  # 1 < the 8 candidates it needs: not enough
    np.testing.assert_array_equal(result.tokens, expected.tokens)
    np.testing.assert_array_equal(on_few.beam_scores, on_logits.beam_scores)  # the same float64 path, bit for bit


def test_step_logits_take_keeps_rows_in_order():
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    step = step_logits(x, 2)
    part = step.take(np.array([3, 1]))
    np.testing.assert_array_equal(part.logits, x[[3, 1]])
    np.testing.assert_array_equal(part.top_ids, step.top_ids[[3, 1]])
    assert part.k == 2
