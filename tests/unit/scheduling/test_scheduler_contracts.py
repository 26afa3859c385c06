"""Contracts of the schedulers that clients and operators rely on, against the fake numpy backend (no ONNX, fast):
which requests a failure fails and what it says (in the error and in the log), the messages of 503 / 429 / 504,
Retry-After, the gauges (rows included) before, during and after a run, admission limits, and the per-request
phases and latency metrics."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from service.decoding import GreedySearch
from service.errors import (Cancelled, DeadlineExceeded, QueueFull, ServiceError, Unavailable,
                            VersionUnloaded)
from service.observability.metrics import Metrics
from service.scheduling import queueing
from service.scheduling.continuous import ContinuousBatcher
from service.scheduling.dynamic import DynamicBatcher
from service.scheduling.jobs import ImageJob, TextJob
from tests.support.batchers import hold, job
from tests.support.fake_decoding import EOS, POISON, RESULT_TIMEOUT_S, ExplodingSearch, FakeBackend, alone
from tests.support.waiting import PATIENCE_S

LABELS = {"model": "m", "version": "1"}
MODE = {**LABELS, "mode": "x"}
LOGGER = "service.scheduling.continuous"


class ConcatFailingBackend(FakeBackend):
    """A fake backend whose next `concatenate` raises once `fail_concatenate` is set."""

    def __init__(self):
        super().__init__()
        self.fail_concatenate = False

    def concatenate(self, states, rows=None):
        if self.fail_concatenate:
            self.fail_concatenate = False
            raise RuntimeError("concatenate failed")
        return super().concatenate(states, rows)







def outcome(j: TextJob):
    try:
        return [(h.tokens, h.finish_reason) for h in j.future.result(timeout=RESULT_TIMEOUT_S)]
    except ServiceError as error:
        return type(error)


def value(metrics: Metrics, name: str, labels=LABELS):
    return metrics.registry.get_sample_value(name, labels)


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.ERROR]


def eventually(predicate, timeout: float = PATIENCE_S) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.002)
    return predicate()


# --- a failure fails exactly the requests it concerns, and says so ------------------------------------------------


def test_a_failing_join_fails_the_newcomers_only_and_is_logged(batcher, caplog):
    b = batcher(ConcatFailingBackend())
    running = hold(b)
    b.backend.fail_concatenate = True
    newcomer = b.submit(job([4, 5], GreedySearch(6, None)))
    b.backend.gate.set()
    assert outcome(newcomer) is ServiceError
    assert str(newcomer.future.exception()).startswith("prefill failed: concatenate failed")
    assert outcome(running) == alone([1, 2], GreedySearch(200, None))
    assert "joining 1 request(s) to the batch of m failed" in messages(caplog)
    assert not any(m.startswith("decoding step failed") for m in messages(caplog))
    later = b.submit(job([6], GreedySearch(4, None)))
    assert outcome(later) == alone([6], GreedySearch(4, None))


def test_a_failing_prefill_on_an_idle_batcher_fails_its_newcomers_and_leaves_nothing_in_flight(batcher, caplog):
    b = batcher()
    poisoned = b.submit(job([3, POISON], GreedySearch(5, None)))
    assert outcome(poisoned) is ServiceError
    assert str(poisoned.future.exception()) == "prefill failed: poisoned prompt"
    assert eventually(lambda: b._in_flight() == [])
    assert "prefill failed for 1 request(s) of m" in messages(caplog)
    assert value(b.metrics, "tserve_running_requests") == 0


def test_a_failing_search_and_a_failing_step_are_logged_with_the_model(batcher, caplog):

    b = batcher()
    exploding = b.submit(job([1], ExplodingSearch(5, 2)))
    assert outcome(exploding) is ServiceError
    assert "decoding failed for one request of m" in messages(caplog)
    running = hold(b)
    b.backend.fail_step = True
    b.backend.gate.set()
    assert outcome(running) is ServiceError
    assert "decoding step failed for m" in messages(caplog)


def test_a_request_that_ends_at_its_prefill_logs_no_error(batcher, caplog):
    b = batcher()
    one = b.submit(job([2, 3], GreedySearch(1, None)))
    assert outcome(one) == alone([2, 3], GreedySearch(1, None))
    after = b.submit(job([5], GreedySearch(3, None)))
    assert outcome(after) == alone([5], GreedySearch(3, None))
    assert messages(caplog) == []


# --- deadlines say where the request was -------------------------------------------------------------------------


def test_a_deadline_mid_decode_says_during_decoding(batcher):
    b = batcher()
    running = hold(b)
    running.deadline = time.monotonic() - 1
    b.backend.gate.set()
    assert outcome(running) is DeadlineExceeded
    assert str(running.future.exception()) == "the request's deadline expired during decoding"


def test_a_deadline_in_the_queue_says_while_it_waited(batcher):
    b = batcher()
    running = hold(b)
    queued = b.submit(job([3], GreedySearch(5, None)))
    queued.deadline = time.monotonic() - 1
    b.backend.gate.set()
    assert outcome(queued) is DeadlineExceeded
    assert str(queued.future.exception()) == "the request's deadline expired while it waited in the queue"
    assert outcome(running) == alone([1, 2], GreedySearch(200, None))


@pytest.mark.parametrize("how", ["client", "future"])
def test_a_request_cancelled_in_the_queue_is_never_prefilled(batcher, how):
    b = batcher()
    running = hold(b, max_new=20)
    queued = b.submit(job([3, 4, 5], GreedySearch(5, None)))
    queued.cancel() if how == "client" else queued.future.cancel()
    b.backend.gate.set()
    assert outcome(running) == alone([1, 2], GreedySearch(20, None))
    if how == "client":
        with pytest.raises(Cancelled):
            queued.future.result(timeout=RESULT_TIMEOUT_S)
    assert value(b.metrics, "tserve_prompt_tokens_total") == 2  # the running prompt only
    assert set(b.backend.step_rows) == {1}


# --- admission limits ------------------------------------------------------------------------------------------


def test_max_prefill_bounds_the_newcomers_of_one_step(batcher):
    b = batcher(max_prefill=1)
    running = hold(b, max_new=20)
    queued = [b.submit(job([3 + i], GreedySearch(5, None))) for i in range(2)]
    b.backend.gate.set()
    for j, i in zip(queued, range(2)):
        assert outcome(j) == alone([3 + i], GreedySearch(5, None))
    assert outcome(running) == alone([1, 2], GreedySearch(20, None))
    assert b.backend.step_rows[:3] == [1, 2, 3]  # one newcomer per step boundary


def test_a_newcomer_that_fills_the_batch_exactly_is_admitted(batcher):
    b = batcher(max_rows=2)
    running = hold(b, max_new=20)
    newcomer = b.submit(job([3], GreedySearch(5, None)))
    b.backend.gate.set()
    assert outcome(newcomer) == alone([3], GreedySearch(5, None))
    assert outcome(running) == alone([1, 2], GreedySearch(20, None))
    assert b.backend.step_rows[1] == 2


# --- gauges -------------------------------------------------------------------------------------------------------


def test_the_rows_gauge_reads_zero_before_and_the_live_rows_while_running(batcher):
    b = batcher(start=False)
    assert value(b.metrics, "tserve_batch_rows") == 0
    b.start()
    running = hold(b)
    assert value(b.metrics, "tserve_batch_rows") == 1
    assert value(b.metrics, "tserve_running_requests") == 1
    b.backend.gate.set()
    outcome(running)
    assert eventually(lambda: value(b.metrics, "tserve_batch_rows") == 0)


def test_stop_waits_for_a_running_request_to_finish(batcher):
    b = batcher()
    running = hold(b, max_new=30)
    stopper = threading.Thread(target=b.stop, args=(RESULT_TIMEOUT_S,))
    stopper.start()
    assert eventually(lambda: not b._accepting)
    b.backend.gate.set()
    stopper.join(timeout=RESULT_TIMEOUT_S)
    assert not stopper.is_alive()
    assert outcome(running) == alone([1, 2], GreedySearch(30, None))
    assert value(b.metrics, "tserve_queue_depth") == 0
    assert value(b.metrics, "tserve_running_requests") == 0
    assert value(b.metrics, "tserve_batch_rows") == 0


def test_stop_fails_the_leftovers_with_a_503_that_says_why(batcher):
    b = batcher(start=False)
    queued = b.submit(job([3], GreedySearch(5, None)))
    b.stop(timeout=1)
    assert outcome(queued) is Unavailable
    assert str(queued.future.exception()) == "the server shut down before this request finished"
    with pytest.raises(Unavailable, match="^the server is shutting down$"):
        b.submit(job([4], GreedySearch(5, None)))
    assert value(b.metrics, "tserve_queue_depth") == 0


def test_a_version_unloaded_past_its_drain_fails_the_leftovers_saying_so_not_that_the_server_shut_down(
        batcher, monkeypatch):
    """Issue 51 item 12: the scheduler of a version unloaded under traffic (model control) tells the requests still
    running or waiting that their version was unloaded (503 `model_unloaded`, failure reason `unloaded`), and the
    ones that arrive after it stopped accepting the same, never that the server shut down."""
    monkeypatch.setattr(queueing, "STOP_JOIN_S", 0.2)
    b = batcher()
    running = hold(b)  # held in its step: it cannot finish before the stop
    queued = b.submit(job([3], GreedySearch(5, None)))
    b.stop(timeout=0, closing=queueing.unloading("m", 1, drain_timeout_s=3))
    b.backend.gate.set()
    for leftover in (running, queued):
        error = leftover.future.exception(timeout=RESULT_TIMEOUT_S)
        assert isinstance(error, VersionUnloaded) and (error.status, error.type, error.reason) == (
            503, "model_unloaded", "unloaded"), error
        assert str(error).startswith("model 'm' version 1 was unloaded before this request finished")
        assert "TSERVE_DRAIN_TIMEOUT_S=3" in str(error) and "shut down" not in str(error)
    with pytest.raises(VersionUnloaded, match="^model 'm' version 1 is being unloaded; retry"):
        b.submit(job([4], GreedySearch(5, None)))


def test_a_stopped_image_batcher_does_not_grow_a_rows_gauge():
    metrics = Metrics()
    d = DynamicBatcher(object(), "vit", 1, metrics, max_batch_size=4, max_queue_delay_ms=1, max_queue=4,
                       batching=True)
    d.stop(timeout=1)
    assert metrics.registry.get_sample_value("tserve_batch_rows", {"model": "vit", "version": "1"}) is None
    assert metrics.registry.get_sample_value("tserve_queue_depth", {"model": "vit", "version": "1"}) == 0


def test_an_image_job_expired_in_the_queue_says_where_it_was():
    metrics = Metrics()
    d = DynamicBatcher(object(), "vit", 1, metrics, max_batch_size=4, max_queue_delay_ms=1, max_queue=4,
                       batching=True)
    expired = ImageJob(pixels=np.zeros((1, 1, 4, 4), np.float32), deadline=time.monotonic() - 1)
    d.submit(expired)
    d.start()
    try:
        with pytest.raises(DeadlineExceeded) as error:
            expired.future.result(timeout=RESULT_TIMEOUT_S)
        assert str(error.value) == "the request's deadline expired before its images were classified"
    finally:
        d.stop(timeout=PATIENCE_S)


# --- the queue ----------------------------------------------------------------------------------------------------


def test_max_queue_and_workers_must_be_positive_and_one_is_enough(batcher):
    with pytest.raises(ValueError, match="^max_queue must be >= 1$"):
        ContinuousBatcher(FakeBackend(), "m", 1, Metrics(), max_rows=4, max_prefill=1, max_queue=0)
    with pytest.raises(ValueError, match="^workers must be >= 1$"):
        ContinuousBatcher(FakeBackend(), "m", 1, Metrics(), max_rows=4, max_prefill=1, max_queue=1, workers=0)
    b = batcher(start=False, max_queue=1)
    b.submit(job([1], GreedySearch(2, None)))
    assert b.queue_depth == 1


def test_a_full_queue_answers_429_with_both_retry_headers(batcher):
    b = batcher(start=False, max_queue=1)
    b.submit(job([1], GreedySearch(2, None)))
    with pytest.raises(QueueFull) as error:
        b.submit(job([2], GreedySearch(2, None), timeout=30.0))
    assert str(error.value) == "m queue is full (1 waiting requests)"
    assert error.value.headers["Retry-After"] == "1"
    assert 1 <= int(error.value.headers["retry-after-ms"]) <= 2 * 1000 * queueing.INITIAL_DEPARTURE_INTERVAL_S + 1


def test_the_worker_is_a_named_daemon_thread(batcher):
    b = batcher(start=False)
    assert [(t.name, t.daemon) for t in b._threads] == [("batcher-m-1", True)]
    two = batcher(start=False, workers=2)
    assert [(t.name, t.daemon) for t in two._threads] == [("batcher-m-1-0", True), ("batcher-m-1-1", True)]


def test_retry_after_follows_the_measured_departure_interval(monkeypatch):
    monkeypatch.setattr(queueing.random, "random", lambda: 0.0)
    r = queueing.RetryAfter()
    r.departed(now=10.0)
    r.departed(now=11.0)  # one departure 1 s after the previous: the average moves a tenth of the way to 1 s
    expected = queueing.INITIAL_DEPARTURE_INTERVAL_S + queueing.DEPARTURE_SMOOTHING * (
        1.0 - queueing.INITIAL_DEPARTURE_INTERVAL_S)
    assert r.milliseconds(1, 1, float("inf")) == int(np.ceil(1000 * expected))
    r.departed(4, now=13.0)  # four departures over 2 s: 0.5 s each
    expected += queueing.DEPARTURE_SMOOTHING * (0.5 - expected)
    assert r.milliseconds(1, 1, float("inf")) == int(np.ceil(1000 * expected))


# --- phases and latency metrics -----------------------------------------------------------------------------------


def test_a_finished_request_records_its_phases_and_latencies(batcher):
    b = batcher()
    done = b.submit(job([1, 2, 3], GreedySearch(5, None)))
    assert outcome(done) == alone([1, 2, 3], GreedySearch(5, None))
    p = done.phases
    assert None not in (p.admitted_at, p.first_token_at, p.finished_at)
    assert done.arrived <= p.admitted_at <= p.first_token_at <= p.finished_at
    assert p.generated == 5
    m = b.metrics
    assert value(m, "tserve_time_to_first_token_seconds_count", MODE) == 1
    assert 0 <= value(m, "tserve_time_to_first_token_seconds_sum", MODE) <= p.first_token_at - done.arrived + 1e-6
    assert value(m, "tserve_inter_token_latency_seconds_count", MODE) == 4
    assert 0 <= value(m, "tserve_inter_token_latency_seconds_sum", MODE) <= p.finished_at - p.first_token_at + 1e-6
    assert 0 <= value(m, "tserve_queue_wait_seconds_sum", MODE) <= p.admitted_at - done.arrived + 1e-6


def test_each_decoding_iteration_is_timed_and_stamped(batcher):
    """`tserve_batch_seconds` (Triton's compute_infer) counts every step the batch size counts."""
    b = batcher()
    before = time.time()
    jobs = [b.submit(job([1, 2], GreedySearch(4, None))), b.submit(job([3], GreedySearch(2, None)))]
    assert all(isinstance(outcome(j), list) for j in jobs)
    labels = LABELS
    steps = b.metrics.registry.get_sample_value("tserve_batch_size_count", labels)
    assert steps and b.metrics.registry.get_sample_value("tserve_batch_seconds_count", labels) == steps
    assert b.metrics.registry.get_sample_value("tserve_batch_seconds_sum", labels) > 0
    assert before <= b.metrics.registry.get_sample_value("tserve_last_batch_timestamp_seconds", labels) <= time.time()


# --- several decoding workers ------------------------------------------------------------------------------------


class ThreadRecordingBackend(FakeBackend):
    """A fake backend that records which worker thread ran each step."""

    def __init__(self):
        super().__init__()
        self.step_threads: list[str] = []

    def step(self, state, tokens):
        self.step_threads.append(threading.current_thread().name)
        return super().step(state, tokens)


def test_two_workers_share_the_queue_and_every_request_decodes_as_if_alone(batcher):
    """Both lanes decode by construction, however fast one lane alone would have been (a busy machine): the steps
    are held until both lanes hold requests; the later half joins running batches."""
    backend = ThreadRecordingBackend()
    backend.gate.clear()
    b = batcher(backend, workers=2)
    searches = [lambda n=n: GreedySearch(4 + n % 7, EOS) for n in range(24)]
    jobs = []
    for n, make in enumerate(searches):
        jobs.append(b.submit(job([1 + n % 9, 2 + n % 5, n % 3], make())))
        if n == len(searches) // 2:
            assert eventually(lambda: all(lane.active for lane in b._lanes)), "a lane took none of the queue"
            backend.gate.set()
        if n % 5 == 0:
            time.sleep(0.002)  # some join running batches
    for n, (j, make) in enumerate(zip(jobs, searches)):
        assert outcome(j) == alone([1 + n % 9, 2 + n % 5, n % 3], make())
    assert set(b.backend.step_threads) == {"batcher-m-1-0", "batcher-m-1-1"}  # both lanes decoded
    assert eventually(lambda: (value(b.metrics, "tserve_running_requests"), value(b.metrics, "tserve_batch_rows"),
                               value(b.metrics, "tserve_queue_depth")) == (0, 0, 0))


def test_one_request_at_a_time_stays_on_the_first_worker(batcher):
    """Idle workers leave a request to the first idle one (`ContinuousBatcher._defers`): a load one lane holds
    does not alternate between the workers' threads. Each request is sent once both lanes are idle (a lane is
    published idle just after its last request's result: one sent in between may go to the other lane)."""
    b = batcher(ThreadRecordingBackend(), workers=2)
    for n in range(8):
        assert eventually(lambda: not any(lane.active or lane.admitting for lane in b._lanes))
        assert outcome(b.submit(job([1 + n, 2], GreedySearch(3, EOS)))) == alone([1 + n, 2], GreedySearch(3, EOS))
    assert set(b.backend.step_threads) == {"batcher-m-1-0"}


def test_waiting_requests_are_shared_between_the_workers_by_rows(batcher):
    backend = FakeBackend()
    backend.gate.clear()  # every step waits: the lanes keep what they admitted
    b = batcher(backend, start=False, workers=2)
    jobs = [b.submit(job([n, 2], GreedySearch(50, None))) for n in range(1, 7)]
    b.start()
    deadline = time.monotonic() + PATIENCE_S
    while sum(len(lane.active) for lane in b._lanes) < len(jobs) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sorted(len(lane.active) for lane in b._lanes) == [3, 3]  # six one-row requests: three rows each
    assert (value(b.metrics, "tserve_queue_depth"), value(b.metrics, "tserve_running_requests"),
            value(b.metrics, "tserve_batch_rows")) == (0, 6, 6)
    backend.gate.set()
    assert all(outcome(j) == alone([n, 2], GreedySearch(50, None)) for n, j in enumerate(jobs, start=1))


def test_a_failing_step_fails_only_the_requests_of_its_own_worker(batcher, caplog):
    backend = FakeBackend()
    backend.gate.clear()
    b = batcher(backend, start=False, workers=2)
    jobs = [b.submit(job([n, 3], GreedySearch(40, None))) for n in (1, 2)]
    b.start()
    deadline = time.monotonic() + PATIENCE_S
    while not all(lane.active for lane in b._lanes) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert [len(lane.active) for lane in b._lanes] == [1, 1]
    backend.fail_step = True  # the first step to run raises; the other lane's steps go on
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        backend.gate.set()
        outcomes = [outcome(j) for j in jobs]
    failed = [n for n, o in zip((1, 2), outcomes) if o is ServiceError]
    assert len(failed) == 1
    survivor = 3 - failed[0]
    assert outcomes[survivor - 1] == alone([survivor, 3], GreedySearch(40, None))
    assert "decoding step failed for m" in caplog.text
