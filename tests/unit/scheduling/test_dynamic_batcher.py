"""DynamicBatcher against a fake engine: batch assembly (size bound, delay bound, no split jobs, chunking of
oversized jobs, batching off), result routing, the bounded queue, deadlines, cancellation, engine failures,
draining on stop, and the metrics it observes."""

from __future__ import annotations

import threading
import time
from concurrent.futures import wait

import numpy as np
import pytest

from service.errors import (
    Cancelled,
    DeadlineExceeded,
    QueueFull,
    ServiceError,
    Unavailable,
)
from service.observability.metrics import Metrics
from service.scheduling.dynamic import DynamicBatcher
from service.scheduling.jobs import ImageJob
from service.settings import Settings
from tests.support.waiting import PATIENCE_S

CLASSES = 10
SHAPE = (1, 4, 4)  # (C, H, W): 16 values per image, the first 10 become its logits
LABELS = {"model": "vit", "version": "1"}
DEFAULTS = Settings.model_construct()  # the declared defaults, whatever the environment says
LIMITS = {"max_batch_size": DEFAULTS.vit_max_batch_size, "max_queue_delay_ms": DEFAULTS.vit_max_queue_delay_ms,
          "max_queue": DEFAULTS.max_queue_size, "batching": DEFAULTS.vit_batching}  # a test's options replace these


class FakeEngine:
    """Logits = the first 10 pixel values of each image. Records every call's batch size; can be held at a gate
    (to pile up a queue deterministically) and made to fail on images holding a poison value."""

    POISON = -999.0

    def __init__(self, delay: float = 0.0):
        self.calls: list[int] = []
        self.call_times: list[float] = []
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def logits(self, batch: np.ndarray) -> np.ndarray:
        self.call_times.append(time.monotonic())
        self.calls.append(len(batch))
        self.entered.set()
        assert self.gate.wait(timeout=PATIENCE_S), "test never opened the gate"
        if self.delay:
            time.sleep(self.delay)
        if (batch == self.POISON).any():
            raise RuntimeError("poisoned batch")
        B = len(batch)
        return batch.reshape(B, -1)[:, :CLASSES].copy()  # (B, classes)


def images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *SHAPE)).astype(np.float32)  # (n, C, H, W)


def expected(pixels: np.ndarray) -> np.ndarray:
    return pixels.reshape(len(pixels), -1)[:, :CLASSES]


def job(n: int = 1, seed: int = 0, timeout: float = 10.0) -> ImageJob:
    return ImageJob(pixels=images(n, seed), deadline=time.monotonic() + timeout)


@pytest.fixture
def metrics():
    return Metrics()


@pytest.fixture
def make(metrics):
    """Build, start and (at teardown) stop batchers."""
    batchers = []

    def build(engine, **kwargs) -> DynamicBatcher:
        batcher = DynamicBatcher(engine, "vit", 1, metrics, **{**LIMITS, **kwargs})
        batcher.start()
        batchers.append(batcher)
        return batcher

    yield build
    for batcher in batchers:
        batcher.engine.gate.set()
        batcher.stop(timeout=PATIENCE_S)


def hold(engine: FakeEngine, batcher: DynamicBatcher) -> ImageJob:
    """Close the gate and put one 1-image job into the engine, so the jobs submitted next pile up in the queue."""
    engine.gate.clear()
    engine.entered.clear()
    blocker = batcher.submit(job(1, seed=999))
    assert engine.entered.wait(PATIENCE_S)
    return blocker


def results(jobs: list[ImageJob], timeout: float = PATIENCE_S) -> list:
    done, pending = wait([j.future for j in jobs], timeout=timeout)
    assert not pending, "some jobs never finished"
    return [j.future.result() for j in jobs]


# --- batch assembly -----------------------------------------------------------------------------------------


def test_batches_fill_up_to_max_batch_size_without_splitting_jobs(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch_size=8, max_queue_delay_ms=50)
    blocker = hold(engine, batcher)
    jobs = [batcher.submit(job(n, seed=i)) for i, n in enumerate([3, 3, 3, 2, 5, 1, 8, 1])]
    engine.gate.set()
    results(jobs + [blocker])
    # in arrival order: [3,3] (the next 3 would overflow), [3,2] (5 would overflow), [5,1], [8], [1]
    assert engine.calls == [1, 6, 5, 6, 8, 1]
    assert max(engine.calls) <= 8


def test_a_full_batch_goes_without_waiting_for_the_delay(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch_size=4, max_queue_delay_ms=5_000)
    started = time.monotonic()
    jobs = [batcher.submit(job(2, seed=i)) for i in range(2)]
    results(jobs, timeout=3)
    assert time.monotonic() - started < 2.5
    assert engine.calls == [4]


def test_a_lone_job_runs_after_the_queue_delay_not_much_later(make):
    engine = FakeEngine()
    delay_ms = 50
    batcher = make(engine, max_batch_size=64, max_queue_delay_ms=delay_ms)
    lone = batcher.submit(job(1))
    results([lone])
    waited = engine.call_times[0] - lone.arrived
    assert delay_ms / 1000 * 0.9 <= waited < delay_ms / 1000 * 10
    assert engine.calls == [1]


def test_jobs_arriving_within_the_delay_share_a_batch(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch_size=64, max_queue_delay_ms=300)
    first = batcher.submit(job(2, seed=1))
    time.sleep(0.02)
    second = batcher.submit(job(3, seed=2))
    results([first, second])
    assert engine.calls == [5]


def test_zero_delay_does_not_wait(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch_size=64, max_queue_delay_ms=0)
    lone = batcher.submit(job(1))
    results([lone], timeout=2)
    assert engine.call_times[0] - lone.arrived < 0.5


def test_results_go_back_to_the_right_job_in_order(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch_size=16, max_queue_delay_ms=20)
    blocker = hold(engine, batcher)
    jobs = [batcher.submit(job(n, seed=i)) for i, n in enumerate([1, 4, 2, 7, 3, 5, 1])]
    engine.gate.set()
    for j, logits in zip(jobs, results(jobs + [blocker])[:-1]):
        assert logits.shape == (j.size, CLASSES) and logits.dtype == np.float32
        np.testing.assert_array_equal(logits, expected(j.pixels))
    assert sum(engine.calls) == 1 + 23 and len(engine.calls) < 1 + len(jobs)  # they were batched


def test_batching_off_runs_one_job_per_call(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch_size=64, max_queue_delay_ms=50, batching=False)
    blocker = hold(engine, batcher)
    sizes = [2, 1, 3, 1]
    jobs = [batcher.submit(job(n, seed=i)) for i, n in enumerate(sizes)]
    engine.gate.set()
    for j, logits in zip(jobs, results(jobs + [blocker])[:-1]):
        np.testing.assert_array_equal(logits, expected(j.pixels))
    assert engine.calls == [1, *sizes]


def test_an_oversized_job_runs_alone_in_chunks(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch_size=4, max_queue_delay_ms=50)
    blocker = hold(engine, batcher)
    small, big, after = batcher.submit(job(1, seed=1)), batcher.submit(job(10, seed=2)), batcher.submit(job(2, 3))
    engine.gate.set()
    out = results([small, big, after, blocker])
    assert engine.calls == [1, 1, 4, 4, 2, 2]
    np.testing.assert_array_equal(out[1], expected(big.pixels))
    np.testing.assert_array_equal(out[2], expected(after.pixels))


# --- the queue, deadlines, cancellation, failures -----------------------------------------------------------


def test_a_full_queue_raises_queue_full_with_retry_after(make, metrics):
    engine = FakeEngine()
    batcher = make(engine, max_batch_size=4, max_queue=2)
    blocker = hold(engine, batcher)
    queued = [batcher.submit(job(1, seed=i)) for i in range(2)]
    assert batcher.queue_depth == 2 and batcher.running == 1
    with pytest.raises(QueueFull) as raised:
        batcher.submit(job(1))
    assert raised.value.status == 429 and int(raised.value.headers["Retry-After"]) >= 1
    assert batcher.retry_after() >= 0
    # counted by the request middleware from the 429, not here (no double counting)
    assert metrics.registry.get_sample_value("tserve_request_failures_total", {**LABELS, "reason": "queue_full"}) is None
    engine.gate.set()
    results(queued + [blocker])


def test_an_expired_job_fails_without_reaching_the_engine(make, metrics):
    engine = FakeEngine()
    batcher = make(engine, max_queue_delay_ms=1)
    expired = batcher.submit(ImageJob(pixels=images(1, 0), deadline=time.monotonic() - 1))
    with pytest.raises(DeadlineExceeded):
        expired.future.result(timeout=PATIENCE_S)
    assert engine.calls == []
    assert metrics.registry.get_sample_value("tserve_request_failures_total", {**LABELS, "reason": "timeout"}) is None


def test_a_job_that_expires_while_queued_is_not_run(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch_size=4, max_queue_delay_ms=1)
    blocker = hold(engine, batcher)
    short, ok = batcher.submit(job(1, seed=1, timeout=0.05)), batcher.submit(job(1, seed=2))
    time.sleep(0.1)
    engine.gate.set()
    with pytest.raises(DeadlineExceeded, match="^the request's deadline expired before its images were classified$"):
        short.future.result(timeout=PATIENCE_S)  # the 504's message says where the request was
    np.testing.assert_array_equal(results([ok, blocker])[0], expected(ok.pixels))
    assert engine.calls == [1, 1]


def test_a_cancelled_job_is_not_run(make):
    engine = FakeEngine()
    batcher = make(engine, max_batch_size=4, max_queue_delay_ms=1)
    blocker = hold(engine, batcher)
    gone, ok = batcher.submit(job(1, seed=1)), batcher.submit(job(2, seed=2))
    gone.cancel()
    engine.gate.set()
    with pytest.raises(Cancelled):
        gone.future.result(timeout=PATIENCE_S)
    results([ok, blocker])
    assert engine.calls == [1, 2]
    # counted once per HTTP request by the request middleware (499), not per job here
    assert batcher.metrics.registry.get_sample_value("tserve_request_failures_total",
                                                     {**LABELS, "reason": "cancelled"}) is None


def test_an_engine_error_fails_only_its_batch(make, metrics):
    engine = FakeEngine()
    batcher = make(engine, max_batch_size=4, max_queue_delay_ms=1)
    blocker = hold(engine, batcher)
    bad = job(2, seed=1)
    bad.pixels[1, 0, 0, 0] = FakeEngine.POISON
    bad, neighbour = batcher.submit(bad), batcher.submit(job(2, seed=2))  # one batch of 4
    later = batcher.submit(job(3, seed=3))  # does not fit: the next batch
    engine.gate.set()
    for failed in (bad, neighbour):
        with pytest.raises(ServiceError) as raised:
            failed.future.result(timeout=PATIENCE_S)
        assert raised.value.status == 500 and "poisoned" in raised.value.message
    np.testing.assert_array_equal(results([later, blocker])[0], expected(later.pixels))
    assert engine.calls == [1, 4, 3]
    assert metrics.registry.get_sample_value("tserve_request_failures_total", {**LABELS, "reason": "internal"}) is None
    again = batcher.submit(job(1, seed=4))  # the worker is still serving
    results([again])


# --- shutdown -----------------------------------------------------------------------------------------------


def test_stop_drains_accepted_jobs_then_refuses_new_ones(metrics):
    engine = FakeEngine(delay=0.02)
    batcher = DynamicBatcher(engine, "vit", 1, metrics,
                             **{**LIMITS, "max_batch_size": 2, "max_queue_delay_ms": 1_000})
    batcher.start()
    jobs = [batcher.submit(job(1, seed=i)) for i in range(7)]
    started = time.monotonic()
    batcher.stop(timeout=PATIENCE_S)
    assert time.monotonic() - started < 5  # no queue delay is waited for while draining
    for j, logits in zip(jobs, results(jobs, timeout=0.1)):
        np.testing.assert_array_equal(logits, expected(j.pixels))
    with pytest.raises(Unavailable):
        batcher.submit(job(1))
    assert batcher.queue_depth == 0 and batcher.running == 0


def test_stop_fails_what_it_could_not_drain_with_unavailable(metrics):
    engine = FakeEngine()
    batcher = DynamicBatcher(engine, "vit", 1, metrics, **{**LIMITS, "max_batch_size": 1, "max_queue_delay_ms": 1})
    batcher.start()
    blocker = hold(engine, batcher)
    left = [batcher.submit(job(1, seed=i)) for i in range(3)]
    threading.Timer(0.3, engine.gate.set).start()  # the running batch finishes after the drain timeout
    batcher.stop(timeout=0.1)
    assert blocker.future.result(timeout=PATIENCE_S).shape == (1, CLASSES)
    for j in left:
        with pytest.raises(Unavailable):
            j.future.result(timeout=1)


# --- metrics ------------------------------------------------------------------------------------------------


def test_metrics_are_observed(make, metrics):
    engine = FakeEngine()
    batcher = make(engine, max_batch_size=8, max_queue_delay_ms=1)
    blocker = hold(engine, batcher)
    jobs = [batcher.submit(job(n, seed=i)) for i, n in enumerate([3, 2])]
    assert metrics.registry.get_sample_value("tserve_queue_depth", LABELS) == 2
    assert metrics.registry.get_sample_value("tserve_running_requests", LABELS) == 1
    engine.gate.set()
    results(jobs + [blocker])
    time.sleep(0.05)  # the worker resets the gauges after delivering the results
    sample = metrics.registry.get_sample_value
    assert sample("tserve_images_total", LABELS) == 6
    assert sample("tserve_batch_size_count", LABELS) == 2 and sample("tserve_batch_size_sum", LABELS) == 6
    assert sample("tserve_queue_wait_seconds_count", {**LABELS, "mode": "classify"}) == 3
    assert sample("tserve_queue_depth", LABELS) == 0
    assert sample("tserve_running_requests", LABELS) == 0


# --- the contract's edges ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("limits", [{"max_batch_size": 0}, {"max_queue_delay_ms": -1}])
def test_invalid_limits_are_refused(metrics, limits):
    with pytest.raises(ValueError, match="^max_batch_size must be >= 1 and max_queue_delay_ms >= 0$"):
        DynamicBatcher(FakeEngine(), "vit", 1, metrics, **{**LIMITS, **limits})


class Float64Engine(FakeEngine):
    def logits(self, batch):
        return super().logits(batch).astype(np.float64)


class WrongRowsEngine(FakeEngine):
    def logits(self, batch):
        return super().logits(batch)[:-1]


def test_logits_are_float32_whatever_the_engine_returns(make):
    one = make(Float64Engine(), max_queue_delay_ms=1).submit(job(2, seed=5))
    logits = results([one])[0]
    assert logits.dtype == np.float32
    np.testing.assert_array_equal(logits, expected(one.pixels))


def test_an_engine_answer_of_the_wrong_shape_fails_the_batch_saying_so(make, caplog):
    bad = make(WrongRowsEngine(), max_queue_delay_ms=1).submit(job(3, seed=6))
    with pytest.raises(ServiceError, match=r"^inference failed: engine returned logits of shape \(2, 10\) for 3 "
                                           r"images$") as raised:
        bad.future.result(timeout=PATIENCE_S)
    assert raised.value.status == 500
    assert "image batch failed for vit" in [r.getMessage() for r in caplog.records]


def test_phases_and_queue_wait_are_those_of_the_job(make, metrics):
    """Each job's spans read its phases: started, finished after, its batch's size; its queue wait is measured from
    its arrival (never more than the whole test took)."""
    began = time.monotonic()
    engine = FakeEngine()
    batcher = make(engine, max_batch_size=8, max_queue_delay_ms=1)
    blocker = hold(engine, batcher)
    jobs = [batcher.submit(job(n, seed=i)) for i, n in enumerate([3, 2])]
    engine.gate.set()
    results(jobs + [blocker])
    elapsed = time.monotonic() - began
    for j in jobs:
        assert j.arrived <= j.phases.started_at <= j.phases.finished_at
        assert j.phases.batch_size == 5
    assert blocker.phases.batch_size == 1
    waited = metrics.registry.get_sample_value("tserve_queue_wait_seconds_sum", {**LABELS, "mode": "classify"})
    assert 0 <= waited <= 3 * elapsed


def test_each_batch_is_timed_and_stamped(make, metrics):
    """`tserve_batch_seconds` (Triton's compute_infer) counts every engine call, at least the engine's own time."""
    engine = FakeEngine(delay=0.02)
    batcher = make(engine)
    before = time.time()
    results([batcher.submit(job(2, seed=s)) for s in range(3)])
    labels = {"model": "vit", "version": "1"}
    timed = metrics.registry.get_sample_value("tserve_batch_seconds_count", labels)
    assert timed == len(engine.calls) == metrics.registry.get_sample_value("tserve_batch_size_count", labels)
    assert metrics.registry.get_sample_value("tserve_batch_seconds_sum", labels) >= 0.02 * len(engine.calls)
    assert before <= metrics.registry.get_sample_value("tserve_last_batch_timestamp_seconds", labels) <= time.time()
