"""The queueing helpers every scheduler shares (`service.scheduling.queueing`), table-style: the Retry-After a full
queue answers with (whole seconds, rounded up, at least 1, never past what the request may still wait), the
moving-average departure interval it is estimated from, OpenAI's retry-after-ms spread over [estimate, 2 x
estimate], and the futures' outcomes: set once, a gone request failed with the error that says why."""

from __future__ import annotations

import math
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from service.errors import Cancelled, DeadlineExceeded
from service.scheduling import queueing
from service.scheduling.queueing import (
    DEPARTURE_SMOOTHING,
    INITIAL_DEPARTURE_INTERVAL_S,
    RetryAfter,
    fail,
    fail_if_gone,
    retry_after_seconds,
    settle,
)


@pytest.mark.parametrize("estimate, may_wait, seconds", [
    (0.2, math.inf, 1),      # at least one second: 0 would say "retry at once"
    (2.1, math.inf, 3),      # rounded up
    (3.0, math.inf, 3),
    (7.5, 4.9, 4),           # no more than the whole seconds the request may still wait
    (7.5, 0.3, 1),           # ... but still at least one
    (2.0, 10.0, 2),
])
def test_retry_after_seconds(estimate, may_wait, seconds):
    assert retry_after_seconds(estimate, may_wait) == seconds


def measured() -> tuple[RetryAfter, float]:
    """A RetryAfter that saw one request leave at t=0 and two at t=10: a sample of 5 s per request."""
    retry = RetryAfter()
    retry.departed(1, now=0.0)
    retry.departed(0, now=5.0)  # nothing left: no sample
    retry.departed(2, now=10.0)
    return retry, INITIAL_DEPARTURE_INTERVAL_S + DEPARTURE_SMOOTHING * (5.0 - INITIAL_DEPARTURE_INTERVAL_S)


def test_the_estimate_is_the_departures_needed_at_the_average_interval():
    retry, interval = measured()
    assert retry.seconds(waiting=8, capacity=4, may_wait_s=math.inf) == math.ceil(5 * interval)  # 5 to leave
    assert retry.seconds(waiting=8, capacity=4, may_wait_s=1.5) == 1
    assert RetryAfter().seconds(waiting=30, capacity=4, may_wait_s=math.inf) == \
        math.ceil(27 * INITIAL_DEPARTURE_INTERVAL_S)  # nothing measured yet: the initial interval


@pytest.mark.parametrize("draw, factor", [(0.0, 1.0), (0.5, 1.5), (0.999, 1.999)])
def test_retry_after_ms_is_spread_over_one_to_two_estimates(monkeypatch, draw, factor):
    retry, interval = measured()
    monkeypatch.setattr(queueing, "random", SimpleNamespace(random=lambda: draw))
    # whole milliseconds, rounded up (within 1 ms: the float products round either way)
    assert retry.milliseconds(waiting=8, capacity=4, may_wait_s=math.inf) == pytest.approx(
        1000 * 5 * interval * factor, abs=1)
    assert retry.milliseconds(waiting=2, capacity=4, may_wait_s=math.inf) == pytest.approx(
        1000 * interval * factor, abs=1)
    assert retry.milliseconds(waiting=8, capacity=4, may_wait_s=0.25) == 250  # capped at what it may wait


def test_retry_after_ms_is_at_least_one_millisecond(monkeypatch):
    monkeypatch.setattr(queueing, "random", SimpleNamespace(random=lambda: 0.0))
    assert RetryAfter().milliseconds(waiting=1, capacity=4, may_wait_s=0.0) == 1


def test_an_outcome_is_set_once():
    future = Future()
    assert settle(future, "first") is True
    assert settle(future, "second") is False and fail(future, Cancelled("late")) is False
    assert future.result() == "first"
    failed = Future()
    assert fail(failed, Cancelled("gone")) is True and settle(failed, "late") is False
    with pytest.raises(Cancelled):
        failed.result()


@pytest.mark.parametrize("cancelled, now, error, message", [
    (True, 0.0, Cancelled, "^client went away$"),
    (True, 20.0, Cancelled, "^client went away$"),  # cancelled wins over expired
    (False, 10.5, DeadlineExceeded, "^the request's deadline expired while it waited$"),
])
def test_a_gone_request_fails_saying_why(cancelled, now, error, message):
    future = Future()
    assert fail_if_gone(future, cancelled, deadline=10.0, now=now, where="while it waited") is True
    with pytest.raises(error, match=message):
        future.result()


def test_a_request_at_its_deadline_is_not_gone():
    future = Future()
    assert fail_if_gone(future, False, deadline=10.0, now=10.0, where="x") is False
    assert not future.done()


@pytest.mark.parametrize("estimate, may_wait, seconds, most_ms", [
    (0.1, 0.4, 1, 400),      # a deadline under a second: the least header, and retry-after-ms within the deadline
    (50.0, 0.4, 1, 400),
    (50.0, 3.5, 3, 3500),    # both capped at what the request may still wait
    (0.25, 30.0, 1, 500),    # the estimate (spread up to twice itself) well within the deadline
])
def test_every_429_carries_both_hints_from_one_estimate_within_the_deadline(monkeypatch, estimate, may_wait,
                                                                            seconds, most_ms):
    """Issue 51 item 11: `queue_full` is the one 429 of every route that refuses for want of room (the queues, the
    scoring slots): Retry-After and retry-after-ms, both within the refused request's own deadline."""
    monkeypatch.setattr(queueing, "random", SimpleNamespace(random=lambda: 0.999))
    refused = queueing.queue_full("full", estimate, may_wait)
    assert refused.status == 429 and refused.headers["Retry-After"] == str(seconds)
    assert 1 <= int(refused.headers["retry-after-ms"]) <= most_ms
