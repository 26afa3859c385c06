"""N-gram speculation in the running batch (`service.scheduling.speculation`, `TextBatch.generate_token`), against a
fake model whose verify pass is exact (its logits a function of a row's last tokens, so greedy continuations fall
into loops that drafts predict): with speculation, every greedy request ends as plain decoding ends it, bit for bit
(tokens, score, finish reason at EOS, a stop or max_new_tokens mid-draft, log-probabilities, n-gram bans), in
batches that rows join and leave, while most tokens come out of verify passes; a step with a sampled or beam
request, or more rows than allowed, is a plain one; the continuous batcher counts drafts in vLLM's metrics; a
search that raises in a verify pass fails its request alone; a row's draft length adapts across steps."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np
import pytest

from service.decoding import BeamSearch, GreedySearch, SamplingSearch, run_search
from service.decoding.ngram_draft import FIRST_DRAFT
from service.observability.metrics import Metrics
from service.scheduling.continuous import ContinuousBatcher
from service.scheduling.jobs import TextJob
from service.scheduling.speculation import SpeculationConfig
from service.scheduling.text_batch import TextBatch
from tests.support.fake_decoding import ExplodingSearch

VOCAB, EOS, WINDOW = 9, 0, 2  # the fake model's logits depend on a row's last WINDOW tokens
SURPRISE = 13  # ... and, at every SURPRISE-th position, on the position too: a loop's drafts are rejected there
EOS_BIAS = -2.0  # EOS less likely than the others: continuations last long enough to loop
RESULT_TIMEOUT_S = 30.0


def logits_of(tokens, eos_at: int | None = None) -> np.ndarray:
    """The fake model: logits from the last WINDOW tokens (and the position, every SURPRISE-th); EOS the most likely
    once a row holds `eos_at` tokens."""
    surprise = (len(tokens),) if len(tokens) % SURPRISE == 0 else ()
    seed = hash((*(int(t) for t in tokens[-WINDOW:]), *surprise)) % 2**32
    logits = np.random.default_rng(seed).standard_normal(VOCAB).astype(np.float32)
    logits[EOS] += EOS_BIAS if eos_at is None or len(tokens) < eos_at else -2 * EOS_BIAS + logits.max()
    return logits


@dataclass
class Rows:
    tokens: list[list[int]]

    @property
    def rows(self) -> int:
        return len(self.tokens)


@dataclass
class FakeVerification:
    logits: np.ndarray  # (rows, S, V)
    state: Rows
    fed: list[list[int]]

    def commit(self, kept: np.ndarray) -> None:
        for row, count in enumerate(kept.tolist()):
            assert count <= len(self.fed[row])
            self.state.tokens[row] += self.fed[row][:count]


class LoopingBackend:
    """A `DecodingBackend` that can verify drafts, exactly (`speculates`); counts its steps and verify passes."""

    speculates = True
    context_length = 10_000

    def __init__(self, eos_at: int | None = None):
        self.steps = self.verifies = 0
        self.eos_at = eos_at

    def prefill(self, inputs):
        state = Rows([list(ids) for ids in inputs])
        return np.stack([logits_of(t, self.eos_at) for t in state.tokens]), state

    def step(self, state: Rows, tokens):
        self.steps += 1
        for row, token in zip(state.tokens, tokens.tolist()):
            row.append(token)
        return np.stack([logits_of(t, self.eos_at) for t in state.tokens])

    def verify(self, state: Rows, fed: list[list[int]]) -> FakeVerification:
        self.verifies += 1
        S = max(map(len, fed))
        logits = np.zeros((state.rows, S, VOCAB), np.float32)
        for row, (tokens, new) in enumerate(zip(state.tokens, fed)):
            for i in range(len(new)):
                logits[row, i] = logits_of(tokens + new[: i + 1], self.eos_at)
        return FakeVerification(logits, state, fed)

    def select(self, state: Rows, rows):
        return Rows([list(state.tokens[r]) for r in rows])

    def recycle(self, state, rows):
        pass

    def concatenate(self, states, rows=None):
        rows = rows or [None] * len(states)
        return Rows([list(s.tokens[r]) for s, keep in zip(states, rows)
                     for r in (range(s.rows) if keep is None else keep)])


def alone(prompt: list[int], search, eos_at: int | None = None) -> list[tuple]:
    """The search's results decoded alone by the reference driver, plain steps."""
    history = [list(prompt)]

    def step_fn(tokens, parents):
        nonlocal history
        history = [history[p] + [t] for t, p in zip(tokens.tolist(), parents.tolist())]
        return np.stack([logits_of(h, eos_at) for h in history])

    run_search([search], [logits_of(prompt, eos_at)], step_fn)
    return outcome(search)


def outcome(search) -> list[tuple]:
    return [(h.tokens, h.score, h.finish_reason, h.logprobs) for h in search.results()]


def ends_with(pattern: list[int]):
    """A stop checker: the generated tokens end with `pattern`."""
    return lambda generated: generated[-len(pattern):].tolist() == pattern


def random_greedy(rng: random.Random, prompt: list[int]) -> GreedySearch:
    stop = ends_with([rng.randrange(1, VOCAB), rng.randrange(1, VOCAB)]) if rng.random() < 0.3 else None
    return GreedySearch(rng.randint(1, 60), EOS, min_new_tokens=rng.choice([0, 0, 5]), stop_checker=stop,
                        no_repeat_ngram_size=rng.choice([0, 0, 0, 4]), prefix=prompt,
                        logprobs=rng.choice([None, 0, 2]))


def run_batch(backend, jobs_in_order: list[TextJob], config: SpeculationConfig | None, rng: random.Random
              ) -> dict[TextJob, list]:
    """Decode the jobs through one `TextBatch`, newcomers joining at random steps, collecting each job's tokens
    as handed back (they must add up to its results)."""
    waiting, handed, batch = list(jobs_in_order), {job: [] for job in jobs_in_order}, None
    while waiting or (batch is not None and batch.jobs):
        if waiting and (batch is None or not batch.jobs or rng.random() < 0.3):
            newcomers = [waiting.pop(0) for _ in range(min(len(waiting), rng.randint(1, 2)))]
            joined, generations = TextBatch.prefill(backend, newcomers)
            joined.speculation = config
        else:
            joined, generations = None, batch.generate_token()
        for generation in generations:
            assert generation.error is None
            handed[generation.job] += generation.token_ids
            assert generation.accepted <= generation.drafted
        live = [g.job for g in generations if not g.done]
        if joined is not None:
            joined.filter(live)
            batch = joined if batch is None else TextBatch.concatenate([batch.filter(batch.jobs), joined])
        else:
            batch.filter(live)
    return handed


def make_job(prompt, search) -> TextJob:
    return TextJob(list(prompt), search, "greedy", time.monotonic() + RESULT_TIMEOUT_S)


@pytest.mark.parametrize("seed", range(8))
def test_speculative_greedy_requests_end_exactly_as_plain_decoding_ends_them(seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 6))] for _ in range(8)]
    searches = [random_greedy(random.Random(seed * 100 + i), p) for i, p in enumerate(prompts)]
    references = [alone(p, random_greedy(random.Random(seed * 100 + i), p)) for i, p in enumerate(prompts)]
    backend = LoopingBackend()
    jobs = [make_job(p, s) for p, s in zip(prompts, searches)]
    handed = run_batch(backend, jobs, SpeculationConfig(max_draft=6, max_rows=8), rng)
    for job, reference in zip(jobs, references):
        assert outcome(job.search) == reference
        assert handed[job] == reference[0][0]  # every token handed back once, in order
    assert backend.verifies > 0


def test_most_tokens_come_out_of_verify_passes_and_the_counts_add_up():
    prompt = [1, 2, 3]
    search = GreedySearch(200, None)
    backend = LoopingBackend()
    job = make_job(prompt, search)
    batch, generations = TextBatch.prefill(backend, [job])
    batch.speculation = SpeculationConfig(max_draft=8, max_rows=1)
    passes = drafted = accepted = 0
    while not generations[0].done:
        generations = batch.generate_token()
        passes += 1
        drafted += generations[0].drafted
        accepted += generations[0].accepted
    assert outcome(search) == alone(prompt, GreedySearch(200, None))
    assert passes + accepted == 200 - 1  # a choice per pass, and each accepted draft token; the first: prefill
    assert backend.verifies > 0 and backend.steps + backend.verifies == passes
    assert accepted > 200 / 4  # the loops' drafts are accepted (but where the fake model surprises)


PROMPT, ENDS = [1, 2, 3], range(12, 48)  # where the requests of the next test end (tokens generated)


def ending_search(ending: str, end: int) -> GreedySearch:
    """A greedy search of PROMPT that ends after `end` tokens by `ending` (a stop checker that fires there first;
    EOS: where the fake model makes it the most likely)."""
    stop = (lambda generated: len(generated) == end) if ending == "stop" else None
    return GreedySearch(end if ending == "length" else 4 * end, EOS, stop_checker=stop, logprobs=1)


@pytest.mark.parametrize("ending", ["eos", "stop", "length"])
def test_a_request_that_ends_inside_a_draft_ends_where_plain_decoding_ends(ending):
    inside = 0  # requests that ended in a verify pass, with draft tokens accepted and (but at the length) rejected
    for end in ENDS:
        eos_at = len(PROMPT) + end if ending == "eos" else None
        reference = alone(PROMPT, ending_search(ending, end), eos_at)
        assert reference[0][2] == ending and len(reference[0][0]) == end
        job = make_job(PROMPT, ending_search(ending, end))
        batch, generations = TextBatch.prefill(LoopingBackend(eos_at), [job])
        batch.speculation = SpeculationConfig(max_draft=8, max_rows=1)
        while not generations[0].done:
            generations = batch.generate_token()
        assert outcome(job.search) == reference
        last = generations[0]
        inside += 0 < last.accepted and (ending == "length" or last.accepted < last.drafted)
    assert inside >= 3


@pytest.mark.parametrize("other", ["sample", "beam", "too many rows"])
def test_a_step_with_a_request_it_cannot_replay_or_too_many_rows_is_plain(other):
    backend = LoopingBackend()
    jobs = [make_job([1, 2, 3], GreedySearch(30, None))]
    if other == "sample":
        jobs.append(make_job([4, 5], SamplingSearch(30, None, temperature=0.8, seed=1)))
    elif other == "beam":
        jobs.append(make_job([4, 5], BeamSearch(2, 30, None)))
    else:
        jobs.append(make_job([4, 5], GreedySearch(30, None)))
    batch, generations = TextBatch.prefill(backend, jobs)
    batch.speculation = SpeculationConfig(max_draft=8, max_rows=1 if other == "too many rows" else 8)
    for _ in range(25):
        batch.generate_token()
    assert backend.verifies == 0 and backend.steps == 25


def test_the_continuous_batcher_speculates_and_counts_drafts_in_vllm_metrics():
    metrics = Metrics()
    backend = LoopingBackend()
    b = ContinuousBatcher(backend, "m", 1, metrics, max_rows=8, max_prefill=4, max_queue=16,
                          speculation=SpeculationConfig(max_draft=8, max_rows=4))
    b.start()
    try:
        jobs = [b.submit(make_job([i, 1, 2], GreedySearch(120, None))) for i in range(1, 4)]
        results = [job.future.result(timeout=RESULT_TIMEOUT_S) for job in jobs]
    finally:
        b.stop(timeout=RESULT_TIMEOUT_S)
    for i, hypotheses in zip(range(1, 4), results):
        assert [(h.tokens, h.score, h.finish_reason) for h in hypotheses] == \
            [(t, s, r) for t, s, r, _ in alone([i, 1, 2], GreedySearch(120, None))]

    def value(name: str, **labels) -> float:
        return metrics.registry.get_sample_value(name, {"model": "m", "version": "1", **labels}) or 0.0

    drafts, drafted = value("tserve_spec_decode_num_drafts_total"), value("tserve_spec_decode_num_draft_tokens_total")
    accepted = value("tserve_spec_decode_num_accepted_tokens_total")
    assert backend.verifies > 0 and 0 < drafts <= drafted and 0 < accepted <= drafted
    assert value("tserve_generated_tokens_total", mode="greedy") == 3 * 120  # every choice counted once


def test_a_search_that_raises_in_a_verify_pass_fails_its_request_alone():
    """Two speculating rows; one search raises at a position of a verify pass: its request gets the error (one row
    stepped), the other goes on to the end it reaches alone."""
    backend = LoopingBackend()
    failing, going = make_job([1, 2, 3], ExplodingSearch(100, explode_at=40)), make_job([4, 5], GreedySearch(60, None))
    batch, generations = TextBatch.prefill(backend, [failing, going])
    batch.speculation = SpeculationConfig(max_draft=8, max_rows=2)
    errors = []
    while batch.jobs:
        verifies = backend.verifies
        generations = batch.generate_token()
        for generation in generations:
            if generation.error is not None:
                errors.append((generation.job, generation.rows, type(generation.error), backend.verifies > verifies))
        batch.filter([g.job for g in generations if not g.done and g.error is None])
    assert errors == [(failing, 1, ValueError, True)]
    assert outcome(going.search) == alone([4, 5], GreedySearch(60, None))


def test_a_rows_draft_length_grows_across_steps_as_the_scheduler_filters_the_batch():
    """The row's drafter (its draft length, adapted to acceptance) lasts from step to step, through the `filter`
    the scheduler calls at every step: accepted drafts make longer ones."""
    job = make_job([1, 2, 3], GreedySearch(200, None))
    batch, generations = TextBatch.prefill(LoopingBackend(), [job])
    batch.speculation = SpeculationConfig(max_draft=8, max_rows=1)
    drafted = []
    while not generations[0].done:
        generations = batch.generate_token()
        drafted.append(generations[0].drafted)
        batch.filter([job])
    assert max(drafted) > FIRST_DRAFT
    assert outcome(job.search) == alone([1, 2, 3], GreedySearch(200, None))
