"""The running batch on a backend whose graphs compute each row's most likely tokens (`returns_row_candidates`, the
translator's): its prompt pass and every step ask for as many candidates per row as the batch's searches need
(`row_candidates`), hand the searches the `StepLogits` (only the live rows' when some rows are dead), and every
request decodes to the tokens it gets alone on the full logits."""

from __future__ import annotations

import numpy as np

from service.decoding import BeamSearch, GreedySearch
from service.decoding.distributions import log_softmax
from service.decoding.types import StepLogits, row_candidates
from service.scheduling.text_batch import TextBatch
from tests.support.batchers import job
from tests.support.fake_decoding import EOS, FakeBackend, alone


def with_candidates(logits: np.ndarray, k: int) -> StepLogits:
    """What the graph hands over: float32 log-softmax, each row's k best, ties by lower id."""
    logprobs = log_softmax(logits).astype(np.float32)
    ids = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]
    return StepLogits(logits, np.take_along_axis(logprobs, ids, axis=-1), ids)


class CandidatesBackend(FakeBackend):
    """The fake model, its prompt pass and steps taking `candidates=` (required) and returning `StepLogits`;
    records the candidates asked for by every call."""

    returns_row_candidates = True

    def __init__(self):
        super().__init__()
        self.asked: list[int] = []

    def prefill(self, inputs, *, candidates):
        self.asked.append(candidates)
        logits, state = super().prefill(inputs)
        return with_candidates(logits, candidates), state

    def step(self, state, tokens, *, candidates):
        self.asked.append(candidates)
        return with_candidates(super().step(state, tokens), candidates)


def decode(backend, jobs, leaving=()) -> list[int]:
    """Decode `jobs` in one batch to the end (`leaving` dropped after the prompt pass); the candidates each call
    should have asked for."""
    expected = [row_candidates([j.search for j in jobs])]
    batch, generations = TextBatch.prefill(backend, jobs)
    batch.filter([g.job for g in generations if not g.done and g.job not in leaving])
    while batch.jobs:
        expected.append(row_candidates([j.search for j in batch.jobs]))
        generations = batch.generate_token()
        assert all(g.error is None for g in generations)
        batch.filter([g.job for g in generations if not g.done])
    return expected


def searches():
    return [BeamSearch(3, 8, EOS), GreedySearch(8, EOS), BeamSearch(2, 8, EOS, no_repeat_ngram_size=1)]


def test_a_batch_asks_for_its_searches_candidates_and_decodes_as_on_the_full_logits():
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    jobs = [job(p, s) for p, s in zip(prompts, searches())]
    backend = CandidatesBackend()
    expected = decode(backend, jobs)
    assert backend.asked == expected and max(expected) > 0
    for j, prompt, search in zip(jobs, prompts, searches()):
        assert [(h.tokens, h.finish_reason) for h in j.search.results()] == alone(prompt, search)


def test_a_step_with_dead_rows_hands_the_searches_the_live_rows_candidates():
    prompts = [[1, 2], [3, 4], [5, 6], [7, 8]]
    jobs = [job(p, GreedySearch(6, None)) for p in prompts]
    backend = CandidatesBackend()
    decode(backend, jobs, leaving={jobs[1]})
    assert backend.step_rows[0] == 4  # the first step ran with the departed request's row dead, in place
    for i in (0, 2, 3):
        assert [(h.tokens, h.finish_reason) for h in jobs[i].search.results()] == \
            alone(prompts[i], GreedySearch(6, None))
