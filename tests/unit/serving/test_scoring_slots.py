"""The scoring slots' backpressure (`service.serving.score.ScoringSlots`): one request past `max_scoring_requests`
is refused with the schedulers' 429 (`service.scheduling.queueing.queue_full`), its Retry-After and retry-after-ms
from the measured rate at which slots are given back and within the refused request's own deadline."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from service.errors import QueueFull
from service.scheduling.queueing import INITIAL_DEPARTURE_INTERVAL_S, MS_PER_S, RETRY_JITTER
from service.serving.score import ScoringSlots

LOADED = SimpleNamespace(name="translation", version=1)
LONG_S = 30.0  # a deadline far past any estimate here


@pytest.mark.parametrize("timeout_s", [0.4, 0.05, LONG_S])
def test_a_refused_scoring_request_gets_both_hints_within_its_deadline(timeout_s):
    """Issue 51 item 11: 10 heavy scores with timeout_ms 400 got `Retry-After: 1` and no retry-after-ms."""
    slots = ScoringSlots(1)
    slots.take(LOADED, time.monotonic() + LONG_S)
    with pytest.raises(QueueFull) as refused:
        slots.take(LOADED, time.monotonic() + timeout_s)
    headers = refused.value.headers
    assert "max_scoring_requests" in str(refused.value)
    assert headers["Retry-After"] == "1"  # whole seconds: at least 1, at most the deadline's whole seconds (0 -> 1)
    most_ms = MS_PER_S * min(timeout_s, INITIAL_DEPARTURE_INTERVAL_S * (1 + RETRY_JITTER))  # nothing measured yet
    assert 1 <= int(headers["retry-after-ms"]) <= most_ms + 1, headers

