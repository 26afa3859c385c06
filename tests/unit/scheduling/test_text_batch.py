"""The batched decoding step and the running batch, against the fake numpy model (tests/support/fake_decoding.py).

- `step_searches` over a mixed batch (greedy, sampling with every processor, beam search; logprobs on and off)
  makes, bit for bit, the choices each search makes stepped alone: tokens, scores, finish reasons, log-probs;
- `TextBatch` under random joins (prefill + concatenate), departures (filter) and steps decodes every request as
  the reference driver does alone, and never keeps more than a quarter of its rows dead; its `Generation`s hand
  back each single-row search's tokens (and log-probabilities) once each, in order, and every result when done;
- a search that raises inside a batched step fails alone, wherever the failure happens.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from service.decoding import (
    BeamSearch,
    GreedySearch,
    SamplingSearch,
    StepResult,
    run_search,
    step_searches,
)
from service.scheduling.jobs import TextJob
from service.scheduling.text_batch import DEAD_ROWS_BEFORE_COMPACTION, TextBatch
from tests.support.fake_decoding import EOS, POISON, FakeBackend, alone, extend, history_of, logits_of


def random_search(rng: random.Random, prompt: list[int]):
    """A search of a random kind with random parameters (each call with the same rng state builds the same)."""
    kind = rng.choice(["greedy", "greedy", "sample", "sample", "sample", "beam"])
    max_new = rng.randint(1, 12)
    ngram = rng.choice([0, 0, 2, 3])
    if kind == "greedy":
        return GreedySearch(max_new, EOS, min_new_tokens=rng.choice([0, 3]), no_repeat_ngram_size=ngram,
                            prefix=prompt, logprobs=rng.choice([None, 0, 3]))
    if kind == "beam":
        return BeamSearch(rng.randint(1, 4), max_new, EOS, length_penalty=rng.choice([0.6, 1.0]),
                          no_repeat_ngram_size=ngram, min_new_tokens=rng.choice([0, 2]), prefix=prompt)
    return SamplingSearch(max_new, EOS, temperature=rng.choice([0.0, 0.7, 1.0, 1.3]), top_k=rng.choice([0, 3, 6]),
                          top_p=rng.choice([1.0, 0.8, 0.5]), repetition_penalty=rng.choice([1.0, 1.2]),
                          min_new_tokens=rng.choice([0, 2]), seed=rng.randrange(1000), prefix=prompt,
                          no_repeat_ngram_size=ngram, presence_penalty=rng.choice([0.0, 0.5]),
                          frequency_penalty=rng.choice([0.0, -0.3]), logprobs=rng.choice([None, 2]))


def hypotheses(search) -> list[tuple]:
    return [(h.tokens, h.score, h.finish_reason, h.logprobs) for h in search.results()]


def prompts_for(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(1, POISON) for _ in range(rng.randint(1, 5))] for _ in range(n)]


@pytest.mark.parametrize("seed", range(12))
def test_a_mixed_batch_makes_the_choices_each_search_makes_alone(seed):
    rng = random.Random(seed)
    prompts = prompts_for(rng, 10)
    state = rng.getstate()
    together = [random_search(rng, p) for p in prompts]
    rng.setstate(state)
    apart = [random_search(rng, p) for p in prompts]

    histories = [history_of(p) for p in prompts]

    def step_fn(tokens, parents):
        nonlocal histories
        histories = [extend(histories[p], t) for t, p in zip(tokens, parents)]
        return np.stack([logits_of(h) for h in histories]).astype(np.float32)

    run_search(together, [logits_of(h).astype(np.float32) for h in histories], step_fn)
    for prompt, batched, single in zip(prompts, together, apart):
        history = [history_of(prompt)]

        def step_alone(tokens, parents, history=history):
            history[:] = [extend(history[p], t) for t, p in zip(tokens, parents)]
            return np.stack([logits_of(h) for h in history]).astype(np.float32)

        run_search([single], [logits_of(history[0]).astype(np.float32)], step_alone)
        assert hypotheses(batched) == hypotheses(single)  # scores and log-probs bit for bit


def test_a_search_that_raises_in_a_batched_step_fails_alone():
    searches = [GreedySearch(5, EOS), SamplingSearch(5, EOS, seed=1), GreedySearch(5, EOS), BeamSearch(2, 5, EOS),
                BeamSearch(2, 5, EOS), BeamSearch(2, 5, EOS)]
    searches[2].accept = lambda *args: (_ for _ in ()).throw(ValueError("accept exploded"))
    searches[3].advance = lambda *args: (_ for _ in ()).throw(ValueError("beam exploded"))
    searches[5].mask = lambda x: (_ for _ in ()).throw(ValueError("processor exploded"))
    logits = np.stack([logits_of(i) for i in range(6)])
    outcomes = step_searches(searches, logits, isolate=True)
    assert [type(o) for o in outcomes] == [StepResult, StepResult, ValueError, ValueError, StepResult, ValueError]
    alone = BeamSearch(2, 5, EOS).step(logits[4:5])  # the healthy beam search steps as it would alone
    assert outcomes[4].tokens.tolist() == alone.tokens.tolist() and outcomes[4].parents.tolist() == [0, 0]
    with pytest.raises(ValueError):
        step_searches([GreedySearch(5, EOS), searches[2]], logits[:2])


def test_a_failure_in_the_shared_array_work_is_retried_row_by_row():
    """A search whose processing raises (here: its n-gram state) does not take the batch's other rows with it."""
    good = [SamplingSearch(5, EOS, seed=s, temperature=0.8, top_k=4) for s in range(3)]
    reference = [SamplingSearch(5, EOS, seed=s, temperature=0.8, top_k=4) for s in range(3)]
    bad = SamplingSearch(5, EOS, seed=9, temperature=0.8)
    bad.mask_banned = lambda row: (_ for _ in ()).throw(RuntimeError("broken processor"))
    logits = np.stack([logits_of(i) for i in range(4)])
    outcomes = step_searches([good[0], bad, good[1], good[2]], logits, isolate=True)
    assert isinstance(outcomes[1], RuntimeError)
    expected = [r.step(logits[[0, 2, 3][i]][None]) for i, r in enumerate(reference)]
    assert [o.tokens.tolist() for o in (outcomes[0], outcomes[2], outcomes[3])] == \
        [e.tokens.tolist() for e in expected]


def job(prompt: list[int], search) -> TextJob:
    return TextJob(input_ids=prompt, search=search, mode="test", deadline=time.monotonic() + 60)


def build(prompt: list[int], state) -> object:
    """The search `random_search` builds from rng state `state` (the same one each time)."""
    rng = random.Random()
    rng.setstate(state)
    return random_search(rng, prompt)


@pytest.mark.parametrize("seed", range(10))
def test_a_batch_under_random_joins_and_departures_decodes_each_request_as_alone(seed):
    rng = random.Random(seed)
    backend = FakeBackend()
    batch: TextBatch | None = None
    waiting = []
    for prompt in prompts_for(rng, 24):
        waiting.append((prompt, rng.getstate()))
        rng.random()  # the next request's search gets other parameters
    built, finished, dropped, max_dead_fraction = {}, [], set(), 0.0
    streamed: dict = {}  # job -> (token ids, log-probabilities) its generations handed back
    results: dict = {}  # job -> the hypotheses of its last generation

    def take(generations) -> list:
        """Record what the generations hand back; the jobs that are done."""
        assert all(g.error is None for g in generations)
        for g in generations:
            ids, logprobs = streamed.setdefault(g.job, ([], []))
            ids += g.token_ids
            logprobs += g.logprobs or []
            assert g.done == (g.hypotheses is not None)
            results[g.job] = g.hypotheses
        return [g.job for g in generations if g.done]

    while waiting or (batch is not None and batch.jobs):
        done = []
        if waiting and (batch is None or not batch.jobs or rng.random() < 0.4):
            newcomers = []
            for prompt, state in waiting[: rng.randint(1, 3)]:
                newcomers.append(job(prompt, build(prompt, state)))
                built[newcomers[-1]] = state
            del waiting[: len(newcomers)]
            joined, generations = TextBatch.prefill(backend, newcomers)
            assert [g.job for g in generations] == newcomers and all(g.rows == 1 for g in generations)
            done = take(generations)
            batch = joined if batch is None else TextBatch.concatenate([batch, joined])
        finished += done
        leaving = {j for j in batch.jobs if j not in done and rng.random() < 0.05}
        dropped |= leaving
        batch.filter([j for j in batch.jobs if j not in done and j not in leaving])
        if not batch.jobs:
            continue
        generations = batch.generate_token()
        assert [g.job for g in generations] == batch.jobs
        assert sum(g.rows for g in generations) == batch.live_rows
        max_dead_fraction = max(max_dead_fraction, 1 - batch.live_rows / batch.rows)  # the rows it stepped
        done = take(generations)
        finished += done
        batch.filter([j for j in batch.jobs if j not in done])
    assert len(finished) + len(dropped) == 24
    assert finished and max_dead_fraction <= DEAD_ROWS_BEFORE_COMPACTION + 1e-9
    for j in finished:
        assert [(h.tokens, h.finish_reason) for h in results[j]] == alone(j.input_ids, build(j.input_ids, built[j]))
        if j.search.single_row:  # what was handed back is the hypothesis, token by token
            (hypothesis,) = results[j]
            assert streamed[j] == (hypothesis.tokens, hypothesis.logprobs or [])
        else:
            assert streamed[j] == ([], [])


def test_a_batch_whose_jobs_all_left_has_no_rows():
    """Every request gone (finished or cancelled): no live row, an empty int64 row index (what compaction reads)."""
    jobs = [TextJob(input_ids=[1, 2], search=GreedySearch(max_new_tokens=3, eos_token_id=EOS), mode="greedy",
                    deadline=time.monotonic() + 60) for _ in range(2)]
    batch, _ = TextBatch.prefill(FakeBackend(), jobs)
    np.testing.assert_array_equal(batch.row_indices(), [0, 1])
    batch.filter([])
    rows = batch.row_indices()
    assert rows.dtype == np.int64 and rows.shape == (0,)
    assert batch.live_rows == 0
