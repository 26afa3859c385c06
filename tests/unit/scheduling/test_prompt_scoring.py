"""Prompt log-probabilities in the batch (`TextBatch.prefill`, `score_prompt`) on the fake backend: each prompt
token after the first is scored under the distribution of the position before it (its log-probability, its rank,
the top alternatives, as a generated token's are), only for the jobs that asked, in the prompt pass every newcomer
shares, and the generation is the same as without scoring. The ONNX and PyTorch oracles are
tests/unit/engines/test_prompt_logprobs.py."""

from __future__ import annotations

import numpy as np
import pytest

from service.decoding import GreedySearch
from service.decoding.distributions import log_softmax
from service.scheduling.text_batch import TextBatch, score_prompt
from tests.support.batchers import job
from tests.support.fake_decoding import VOCAB, FakeBackend, history_of, logits_of

PROMPT = [3, 7, 1, 9, 4, 4, 2]


def reference(prompt: list[int]) -> np.ndarray:
    """log-softmax at every prompt position (T, V), float64, straight from the fake model."""
    return log_softmax(np.stack([logits_of(history_of(prompt[: t + 1])) for t in range(len(prompt))]
                                ).astype(np.float64))


@pytest.mark.parametrize("top", [0, 1, 3, VOCAB])
def test_score_prompt_is_each_tokens_log_softmax_rank_and_top_alternatives(top):
    logits = np.stack([logits_of(history_of(PROMPT[: t + 1])) for t in range(len(PROMPT))])
    scores = score_prompt(PROMPT, logits, top)
    expected = reference(PROMPT)
    assert [lp.token_id for lp in scores.tokens] == PROMPT[1:]  # the first token has no score
    for t, (lp, rank) in enumerate(zip(scores.tokens, scores.ranks)):
        row = expected[t]  # position t predicts token t + 1
        assert lp.logprob == pytest.approx(row[PROMPT[t + 1]], abs=1e-12)
        assert rank == 1 + int(np.count_nonzero(row > row[PROMPT[t + 1]]))
        order = np.argsort(-row, kind="stable")[:top]
        assert [token for token, _ in lp.top] == order.tolist()
        np.testing.assert_allclose([value for _, value in lp.top], row[order], atol=1e-12, rtol=0)
    best = [t for t in range(len(PROMPT) - 1) if scores.ranks[t] == 1]
    for t in best:  # a most likely token's value is exactly its top alternative's (lm-eval's greedy check)
        if top:
            assert scores.tokens[t].top[0] == (PROMPT[t + 1], scores.tokens[t].logprob)


def test_a_one_token_prompt_has_nothing_to_score():
    scores = score_prompt([5], logits_of(history_of([5]))[None], 2)
    assert scores.tokens == [] and scores.ranks == []


def test_the_batch_scores_only_the_jobs_that_asked_in_the_shared_prompt_pass():
    backend = FakeBackend()
    asked = job(PROMPT, GreedySearch(3, None), prompt_logprobs=2)
    plain = job([5, 6], GreedySearch(3, None))
    asked_top = job([8, 2, 2], GreedySearch(3, None), prompt_logprobs=0)
    batch, generations = TextBatch.prefill(backend, [asked, plain, asked_top])
    assert backend.scored_passes == [[0, 2]]  # one pass, the rows that asked
    assert plain.prompt_scores is None
    assert [lp.token_id for lp in asked.prompt_scores.tokens] == PROMPT[1:]
    assert all(len(lp.top) == 2 for lp in asked.prompt_scores.tokens)
    assert all(lp.top == [] for lp in asked_top.prompt_scores.tokens)
    np.testing.assert_allclose([lp.logprob for lp in asked_top.prompt_scores.tokens],
                               reference([8, 2, 2])[[0, 1], [2, 2]], atol=1e-12, rtol=0)
    # the first generated tokens are those of a batch that scores nothing
    same = [job(prompt, GreedySearch(3, None)) for prompt in (PROMPT, [5, 6], [8, 2, 2])]
    _, unscored = TextBatch.prefill(FakeBackend(), same)
    assert [g.token_ids for g in generations] == [g.token_ids for g in unscored]


def test_a_batch_without_scoring_jobs_runs_the_plain_prompt_pass():
    backend = FakeBackend()
    TextBatch.prefill(backend, [job(PROMPT, GreedySearch(2, None)), job([1, 2], GreedySearch(2, None))])
    assert backend.scored_passes == []
