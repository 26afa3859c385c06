"""Fault injection in the continuous batcher against a fake numpy backend (no ONNX, fast), and the schedulers'
gauges as a property over random sequences of requests.

The fake model's next-token logits are a deterministic function of a row's whole history, so a request decodes
to the same tokens alone or in any batch, and a wrong row selection or a lost row shows up as a different output.
Faults: a prefill that raises, a decoding step that raises, a search that raises, a stream callback that raises;
cancellation and deadlines in the queue and mid-decode; `stop()` while a step hangs. Afterwards every future is
resolved with the outcome it should have, and every gauge (queue depth, running requests, rows) is exact.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from service.decoding import BeamSearch, GreedySearch, SamplingSearch
from service.errors import (
    Cancelled,
    DeadlineExceeded,
    QueueFull,
    ServiceError,
    Unavailable,
)
from service.observability.metrics import Metrics
from service.scheduling import queueing
from service.scheduling.continuous import ContinuousBatcher
from service.scheduling.dynamic import DynamicBatcher
from service.scheduling.jobs import ImageJob, TextJob
from tests.support.batchers import LIMITS, hold, job
from tests.support.fake_decoding import EOS, POISON, RESULT_TIMEOUT_S, VOCAB, ExplodingSearch, FakeBackend, alone
from tests.support.waiting import PATIENCE_S

LABELS = {"model": "m", "version": "1"}
LATE_AFTER_DEADLINE_S = 0.5  # how late a queued job may fail after its deadline on a busy machine


def make_search(kind: str, max_new: int, prompt: list[int], seed: int = 0):
    if kind == "greedy":
        return GreedySearch(max_new, EOS)
    if kind == "beam":
        return BeamSearch(3, max_new, EOS, prefix=prompt)
    return SamplingSearch(max_new, EOS, temperature=0.9, top_k=6, seed=seed, prefix=prompt)


def outcome(job: TextJob):
    """The job's hypotheses as (tokens, reason) pairs, or its error's class."""
    try:
        return [(h.tokens, h.finish_reason) for h in job.future.result(timeout=RESULT_TIMEOUT_S)]
    except ServiceError as error:
        return type(error)


def gauges(metrics: Metrics) -> tuple[float, float, float]:
    value = metrics.registry.get_sample_value
    return (value("tserve_queue_depth", LABELS), value("tserve_running_requests", LABELS),
            value("tserve_batch_rows", LABELS) or 0.0)


def settle(metrics: Metrics, timeout: float = 2.0) -> tuple[float, float, float]:
    """The gauges once the batcher is idle (they read its state; the worker publishes within a step)."""
    deadline = time.monotonic() + timeout
    while gauges(metrics) != (0, 0, 0) and time.monotonic() < deadline:
        time.sleep(0.005)
    return gauges(metrics)







# --- a failure fails exactly the requests it concerns -----------------------------------------------------------


def test_a_failing_prefill_fails_its_newcomers_only(batcher):
    b = batcher(max_prefill=4)
    running = hold(b)
    poisoned = [b.submit(job([3, POISON], GreedySearch(5, EOS))), b.submit(job([4, 5], GreedySearch(6, EOS)))]
    b.backend.gate.set()
    # the two newcomers shared the failing prefill: both get a 500, the running request goes on
    assert [outcome(j) for j in poisoned] == [ServiceError, ServiceError]
    assert poisoned[0].future.exception().status == 500
    assert outcome(running) == alone([1, 2], GreedySearch(200, None))
    later = b.submit(job([6], GreedySearch(8, EOS)))
    assert outcome(later) == alone([6], GreedySearch(8, EOS))
    assert settle(b.metrics) == (0, 0, 0)


def test_a_failing_step_fails_the_batch_and_the_worker_goes_on(batcher):
    b = batcher()
    running = hold(b)
    b.backend.fail_step = True
    b.backend.gate.set()
    assert outcome(running) is ServiceError
    after = b.submit(job([7, 8], GreedySearch(10, EOS)))
    assert outcome(after) == alone([7, 8], GreedySearch(10, EOS))
    assert settle(b.metrics) == (0, 0, 0)


@pytest.mark.parametrize("explode_at", [1, 2, 5])  # 1: on the prefill logits (admission); later: mid-decode
def test_a_failing_search_fails_its_own_request_only(batcher, explode_at):
    b = batcher(max_prefill=8)
    running = hold(b)
    neighbours = [b.submit(job([i, i + 1], make_search(kind, 12, [i, i + 1], seed=i)))
                  for i, kind in enumerate(["greedy", "beam", "sample"], start=2)]
    bad = b.submit(job([9], ExplodingSearch(20, explode_at)))
    b.backend.gate.set()
    assert outcome(bad) is ServiceError and "search exploded" in bad.future.exception().message
    for i, (kind, neighbour) in enumerate(zip(["greedy", "beam", "sample"], neighbours), start=2):
        assert outcome(neighbour) == alone([i, i + 1], make_search(kind, 12, [i, i + 1], seed=i))
    assert outcome(running) == alone([1, 2], GreedySearch(200, None))
    assert settle(b.metrics) == (0, 0, 0)


def test_a_failing_stream_callback_fails_its_own_request_only(batcher):
    b = batcher()

    def broken(_ids, _logprobs):
        raise OSError("consumer gone")

    streamed = b.submit(job([5], GreedySearch(10, None), on_tokens=broken))
    fine = b.submit(job([6], GreedySearch(10, None)))
    assert outcome(streamed) is ServiceError
    assert outcome(fine) == alone([6], GreedySearch(10, None))
    assert settle(b.metrics) == (0, 0, 0)


# --- cancellation and deadlines ------------------------------------------------------------------------------


def test_cancellation_while_queued_while_admitted_and_mid_decode(batcher):
    b = batcher(max_rows=2, max_prefill=1)
    running = hold(b)
    other = b.submit(job([3], GreedySearch(100_000, None)))  # fills the batch (2 rows) at the next boundary
    queued = b.submit(job([4], GreedySearch(5, EOS)))  # waits: no room
    queued.cancel()
    running.cancel()  # mid-decode
    b.backend.gate.set()
    assert outcome(queued) is Cancelled and outcome(running) is Cancelled
    time.sleep(0.01)
    other.cancel()
    assert outcome(other) is Cancelled
    assert settle(b.metrics) == (0, 0, 0)


def test_a_queued_request_leaves_at_its_deadline_while_the_batch_is_full(batcher):
    backend = FakeBackend()
    b = batcher(backend, max_rows=1)
    running = b.submit(job([1], GreedySearch(100_000, None)))  # keeps the only row busy
    while not backend.step_rows:
        time.sleep(0.001)
    expiring = job([2], GreedySearch(5, EOS), timeout=0.2)
    failed_at = []
    expiring.future.add_done_callback(lambda _: failed_at.append(time.monotonic()))  # runs where it is failed
    b.submit(expiring)
    with pytest.raises(DeadlineExceeded):
        expiring.future.result(timeout=PATIENCE_S)
    late = failed_at[0] - expiring.deadline
    # one step of the fake model is < 1 ms; waiting for the running job instead would take its 100,000 steps
    assert late < LATE_AFTER_DEADLINE_S, f"failed {late * 1000:.0f} ms after its deadline"
    assert b.queue_depth == 0
    running.cancel()
    assert outcome(running) is Cancelled
    assert settle(b.metrics) == (0, 0, 0)


def test_a_deadline_mid_decode_fails_the_request(batcher):
    b = batcher()
    slow = b.submit(job([1], GreedySearch(100_000, None), timeout=0.1))
    assert outcome(slow) is DeadlineExceeded
    assert settle(b.metrics) == (0, 0, 0)


# --- the row cap and the queue -----------------------------------------------------------------------------------


def test_the_row_cap_holds_when_the_batch_starts_empty(batcher):
    """32 texts at beam 8 against 64 rows: an empty batch admits only what fits, never 16 x 8 = 128 rows."""
    b = batcher(max_rows=64, max_prefill=16)
    b.backend.gate.clear()
    jobs = [b.submit(job([i % 10 + 1], BeamSearch(8, 6, EOS, prefix=[i % 10 + 1]))) for i in range(32)]
    b.backend.gate.set()
    for j, i in zip(jobs, range(32)):
        assert outcome(j) == alone([i % 10 + 1], BeamSearch(8, 6, EOS, prefix=[i % 10 + 1]))
    assert max(b.backend.step_rows) <= 64, max(b.backend.step_rows)
    # a request wider than the whole cap still runs, alone
    wide = batcher(max_rows=2)
    assert outcome(wide.submit(job([3], BeamSearch(4, 5, EOS, prefix=[3])))) == alone(
        [3], BeamSearch(4, 5, EOS, prefix=[3]))


def test_retry_after_is_never_longer_than_the_request_may_wait():
    b = ContinuousBatcher(FakeBackend(), "m", 1, Metrics(), **{**LIMITS, "max_queue": 2})  # not started: nothing leaves
    for _ in range(2):
        b.submit(job([1], GreedySearch(5, EOS)))
    b._retry._interval = 500.0  # as if requests left the queue every 500 s
    for timeout in (1.5, 3.0, 30.0):
        with pytest.raises(QueueFull) as refused:
            b.submit(job([1], GreedySearch(5, EOS), timeout=timeout))
        assert 1 <= int(refused.value.headers["Retry-After"]) <= max(1, int(timeout))


@pytest.mark.parametrize("estimate, may_wait, header", [
    (0.2, float("inf"), 1), (1.0, float("inf"), 1), (1.01, float("inf"), 2), (500.0, 3.0, 3), (500.0, 3.9, 3),
    (500.0, 0.5, 1), (2.5, 30.0, 3), (-1.0, float("inf"), 1),
])
def test_retry_after_is_whole_seconds_rounded_up_within_the_wait(estimate, may_wait, header):
    assert queueing.retry_after_seconds(estimate, may_wait) == header
    assert QueueFull("full", header).headers["Retry-After"] == str(header)


def test_a_streamed_request_gets_each_token_once_in_order(batcher):
    b = batcher()
    got: list[int] = []
    got_logprobs: list = []

    def on_tokens(ids, logprobs):
        got.extend(ids)
        got_logprobs.extend(logprobs or [])

    recorded = SamplingSearch(12, EOS, temperature=0.9, seed=3, logprobs=2)
    streamed = b.submit(job([5], recorded, on_tokens=on_tokens))
    beam_tokens: list[int] = []
    beam = b.submit(job([6], BeamSearch(3, 8, EOS, prefix=[6]), on_tokens=lambda ids, _: beam_tokens.extend(ids)))
    (result,) = outcome(streamed)
    assert got == result[0] == alone([5], SamplingSearch(12, EOS, temperature=0.9, seed=3))[0][0]
    assert got_logprobs == recorded.token_logprobs and len(got_logprobs) == len(got)  # each token's, once, in order
    assert outcome(beam) == alone([6], BeamSearch(3, 8, EOS, prefix=[6])) and beam_tokens == []  # beams: no stream
    assert streamed.phases.generated == len(got) and beam.phases.generated is None


# --- shutdown --------------------------------------------------------------------------------------------------


def test_stop_while_a_step_hangs_resolves_every_request(batcher, monkeypatch):
    monkeypatch.setattr(queueing, "STOP_JOIN_S", 0.2)
    b = batcher()
    running = hold(b)
    queued = [b.submit(job([i], GreedySearch(5, EOS))) for i in range(3, 6)]
    b.stop(timeout=0.1)  # the step still hangs: the join times out
    for j in [running, *queued]:
        assert outcome(j) is Unavailable
    b.backend.gate.set()  # the worker leaves its step: it must not resolve anything differently or crash
    b._threads[0].join(timeout=PATIENCE_S)
    assert not b._threads[0].is_alive()
    assert all(outcome(j) is Unavailable for j in [running, *queued])
    assert gauges(b.metrics) == (0, 0, 0)
    with pytest.raises(Unavailable):
        b.submit(job([1], GreedySearch(5, EOS)))


# --- gauges as a property over random sequences -----------------------------------------------------------------


class RecordingBackend(FakeBackend):
    """A `FakeBackend` that writes down which jobs each injected fault hit: a poisoned prefill fails the newcomers
    admitted with it (its worker's `admitting`), a failing step every job of that worker's batch (its `active`).
    Both are read on the worker thread, inside the call that raises, so they are the sets the failure concerns."""

    def __init__(self):
        super().__init__()
        self.batcher: ContinuousBatcher | None = None
        self.prefill_hits: list[set[TextJob]] = []
        self.step_hits: list[set[TextJob]] = []
        self._lock = threading.Lock()

    def _lane(self):
        """The lane of the worker thread calling (its name ends in its number when there are several)."""
        lanes = self.batcher._lanes
        return lanes[0] if len(lanes) == 1 else lanes[int(threading.current_thread().name.rsplit("-", 1)[1])]

    def prefill(self, inputs):
        if any(POISON in ids for ids in inputs):
            self.prefill_hits.append(set(self._lane().admitting))
        return super().prefill(inputs)

    def step(self, state, tokens):
        with self._lock:  # one step takes the injected fault, even with two workers stepping at once
            failing, self.fail_step = self.fail_step, False
        if failing:
            self.step_hits.append(set(self._lane().active))
            raise RuntimeError("step failed")
        return super().step(state, tokens)


NEVER_ENDS = 100_000  # new tokens of a job that is cancelled or expires: it cannot finish before either happens
SHORT_DEADLINES_S = (0.0005, 0.003)  # already past, or past within a few steps


def ending(job: TextJob):
    """The job's hypotheses as (tokens, reason) pairs, or its error as (class, message)."""
    try:
        return [(h.tokens, h.finish_reason) for h in job.future.result(timeout=RESULT_TIMEOUT_S)]
    except ServiceError as error:
        return type(error), error.message


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_text_gauges_equal_the_truth_after_any_mix(batcher, seed, workers):
    """Random requests (greedy, beam, sampling, exploding searches, poisoned prompts), short deadlines,
    cancellations, a full queue and failing steps, each request with its own expected end: the one cancelled ends
    Cancelled, the one given a short deadline DeadlineExceeded, one hit by an injected fault (a poisoned prefill it
    shared, a failing step it was in, its own search raising) fails with that fault's error, and every other one
    completes with the result it gets alone. A scheduler that cancels, expires or fails the wrong job fails this.
    Afterwards the gauges read 0."""
    rng = random.Random(seed)
    backend = RecordingBackend()
    b = batcher(backend, max_rows=rng.choice([4, 8, 24]), max_prefill=rng.choice([1, 3, 16]),
                max_queue=rng.choice([4, 64]), workers=workers)
    backend.batcher = b
    plan = []  # drawn before anything runs, so that each seed's requests do not depend on the machine's timing
    for i in range(60):
        prompt = [rng.randrange(1, POISON) for _ in range(rng.randrange(1, 4))]
        roll, timeout = rng.random(), 30.0
        if roll < 0.08:
            prompt.append(POISON)
            role, search, expect = "poisoned", GreedySearch(5, EOS), None  # whatever prefill it shares
        elif roll < 0.16:
            role, search = "explodes", ExplodingSearch(30, rng.randrange(1, 4))
            expect = (ServiceError, "decoding failed: search exploded")
        elif roll < 0.26:
            role, search, expect = "cancelled", GreedySearch(NEVER_ENDS, None), (Cancelled, "client went away")
        elif roll < 0.34:
            role, search, timeout = "expires", GreedySearch(NEVER_ENDS, None), rng.choice(SHORT_DEADLINES_S)
            expect = DeadlineExceeded
        else:
            kind = rng.choice(["greedy", "beam", "sample"])
            search = make_search(kind, rng.randrange(1, 15), prompt, seed=i)
            role, expect = "completes", alone(prompt, make_search(kind, search.max_new_tokens, prompt, seed=i))
        fail_step, pause = rng.random() < 0.03, rng.choice([0, 0, 0, 0, 0, 0, 0, 0.0005, 0.002, 0.002])
        plan.append(((prompt, search, timeout), role, expect, fail_step, pause))
    assert {role for _, role, *_ in plan} == {"poisoned", "explodes", "cancelled", "expires", "completes"}
    assert any(fail_step for *_, fail_step, _ in plan)
    expected, jobs, roles = {}, [], {}
    for (prompt, search, timeout), role, expect, fail_step, pause in plan:
        try:
            j = b.submit(job(prompt, search, timeout=timeout))
        except QueueFull:
            continue
        jobs.append(j)
        expected[j], roles[j] = expect, role
        if role == "cancelled":
            j.cancel()
        if fail_step:
            backend.fail_step = True
        time.sleep(pause)
    endings = {j: ending(j) for j in jobs}
    prefill_hit = set().union(*backend.prefill_hits)
    step_hit = set().union(*backend.step_hits)
    assert all(j in prefill_hit for j in jobs if roles[j] == "poisoned")  # a poisoned prompt always fails its prefill
    for j in jobs:
        got = endings[j]
        if j in prefill_hit:
            assert got == (ServiceError, "prefill failed: poisoned prompt"), (roles[j], got)
        elif j in step_hit:
            assert got == (ServiceError, "decoding failed: step failed"), (roles[j], got)
        elif expected[j] is DeadlineExceeded:
            assert got[0] is DeadlineExceeded, (roles[j], got)
        else:
            assert got == expected[j], roles[j]
    assert all(j.future.done() for j in jobs)
    assert settle(b.metrics) == (0, 0, 0)
    assert b.queue_depth == 0 and b.running == 0


class FakeImageEngine:
    def __init__(self):
        self.fail_next = False

    def logits(self, batch):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("inference failed")
        return batch.reshape(len(batch), -1)[:, :VOCAB].copy()


@pytest.mark.parametrize("seed", range(4))
def test_image_gauges_equal_the_truth_after_any_mix(seed):
    """The ViT's dynamic batcher under random sizes, deadlines (some already past), cancellations, a full queue and
    engine failures: every job ends, and queue depth and running requests read 0 (the defect: stale at 1 after
    three expired requests)."""
    rng = random.Random(seed)
    engine, metrics = FakeImageEngine(), Metrics()
    b = DynamicBatcher(engine, "m", 1, metrics, max_batch_size=rng.choice([2, 8]), max_queue_delay_ms=1,
                       max_queue=rng.choice([3, 50]), batching=True)
    b.start()
    try:
        jobs = []
        for i in range(80):
            pixels = np.random.default_rng(i).standard_normal((rng.randrange(1, 4), 1, 4, 4)).astype(np.float32)
            deadline = time.monotonic() + rng.choice([30.0] * 5 + [-0.001, 0.001])
            try:
                j = b.submit(ImageJob(pixels=pixels, deadline=deadline))
            except QueueFull as refused:
                assert int(refused.headers["Retry-After"]) <= 30
                continue
            jobs.append(j)
            if rng.random() < 0.15:
                b.cancel(j)
            if rng.random() < 0.05:
                engine.fail_next = True
            if rng.random() < 0.2:
                time.sleep(0.001)
        for j in jobs:
            try:
                logits = j.future.result(timeout=RESULT_TIMEOUT_S)
            except ServiceError:
                continue
            np.testing.assert_array_equal(logits, j.pixels.reshape(j.size, -1)[:, :VOCAB])
        assert settle(metrics) == (0, 0, 0)
    finally:
        b.stop(timeout=PATIENCE_S)
