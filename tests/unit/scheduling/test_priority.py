"""Request priority in the queues (`service.scheduling.priority`): lower levels are served first, then arrival; a
request that waited `max_wait_s` goes first whatever its level; a full queue refuses its least urgent, newest
request (the newcomer, or a waiting one it displaces); both schedulers admit in that order. The schedulers here are
not started: admission is called directly, so nothing depends on timing."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from service.errors import BadInput, QueueFull
from service.observability.metrics import Metrics
from service.scheduling.continuous import ContinuousBatcher, _Lane
from service.scheduling.dynamic import DynamicBatcher
from service.scheduling.jobs import ImageJob, TextJob
from service.scheduling.priority import PriorityPolicy
from service.settings import Settings

LATER = 60.0  # seconds to a deadline no test reaches


def text_job(priority: int, arrived: float | None = None) -> TextJob:
    job = TextJob([1, 2], SimpleNamespace(max_rows=1, single_row=True), "greedy", time.monotonic() + LATER,
                  priority=priority)
    if arrived is not None:
        job.arrived = arrived
    return job


def batcher(max_queue: int = 8, max_rows: int = 64, **policy) -> ContinuousBatcher:
    return ContinuousBatcher(SimpleNamespace(), "gpt", 1, Metrics(), max_rows=max_rows, max_prefill=64,
                             max_queue=max_queue, priority=PriorityPolicy(**policy))


def refusals(scheduler, priority: int, how: str) -> float:
    return scheduler.metrics.registry.get_sample_value(
        "tserve_queue_refusals_total", {"model": "gpt", "version": "1", "priority": str(priority), "how": how}) or 0


def test_a_level_is_the_requests_own_or_the_models_default_and_anything_else_is_a_400():
    policy = PriorityPolicy(levels=4, default=2)
    assert [policy.level(None), policy.level(0), policy.level(3)] == [2, 0, 3]
    for bad in (-1, 4):
        with pytest.raises(BadInput, match=r"priority must be an integer from 0 \(most urgent\) to 3") as refused:
            policy.level(bad)
        assert refused.value.param == "priority"
    assert [policy.row_limit(text_job(p), 64) for p in (0, 1, 2, 3)] == [72, 72, 64, 64]


@pytest.mark.parametrize(("policy", "says"), [
    ({"levels": 2, "default": 2}, "priority default 2 is not a level of 0..1"),
    ({"levels": 3, "default": -1}, "priority default -1 is not a level of 0..2"),
    ({"levels": 0, "default": 0}, "priority default 0 is not a level of 0..-1"),
    ({"max_wait_s": 0}, "max_wait_s must be > 0 and headroom_rows >= 0, got 0, 8"),
    ({"headroom_rows": -1}, "max_wait_s must be > 0 and headroom_rows >= 0, got 10.0, -1"),
])
def test_a_policy_out_of_range_says_which_value(policy, says):
    with pytest.raises(ValueError) as refused:
        PriorityPolicy(**policy)
    assert str(refused.value) == says


def test_the_smallest_valid_policy_is_accepted():
    """One level, a wait just over zero, no headroom: the bounds themselves are valid."""
    policy = PriorityPolicy(levels=1, default=0, max_wait_s=0.5, headroom_rows=0)
    assert policy.level(None) == 0 and policy.row_limit(text_job(0), 16) == 16


def test_the_queue_is_served_by_level_then_arrival():
    scheduler = batcher()
    jobs = [scheduler.submit(text_job(p)) for p in (2, 1, 0, 2, 1, 0)]
    admitted = scheduler._admit(_Lane())
    assert admitted == [jobs[2], jobs[5], jobs[1], jobs[4], jobs[0], jobs[3]]


def test_a_request_starves_at_exactly_max_wait():
    policy = PriorityPolicy(max_wait_s=5.0)
    job = text_job(2, arrived=100.0)
    assert policy.rank(job, 104.999) == (2, 100.0) and policy.rank(job, 105.0) == (-1, 100.0)


def test_an_empty_queue_displaces_nothing():
    assert PriorityPolicy().displaced([], text_job(0), time.monotonic()) is None


def test_a_request_that_waited_max_wait_goes_first_whatever_its_level():
    scheduler = batcher(max_wait_s=5.0)
    now = time.monotonic()
    starved = scheduler.submit(text_job(2, arrived=now - 6.0))
    older_starved = scheduler.submit(text_job(2, arrived=now - 7.0))
    urgent = scheduler.submit(text_job(0))
    assert scheduler._admit(_Lane()) == [older_starved, starved, urgent]


def test_a_full_queue_displaces_its_least_urgent_newest_request_for_a_more_urgent_one():
    scheduler = batcher(max_queue=3)
    first, second, third = (scheduler.submit(text_job(p)) for p in (2, 2, 1))
    urgent = scheduler.submit(text_job(0))
    assert second.future.done() and isinstance(second.future.exception(), QueueFull)
    assert "gave its place to a more urgent one (priority 0)" in str(second.future.exception())
    assert int(second.future.exception().headers["Retry-After"]) >= 1
    assert list(scheduler._waiting) == [urgent, third, first] and refusals(scheduler, 2, "displaced") == 1
    with pytest.raises(QueueFull, match="queue is full"):  # as urgent as the least urgent waiting: refused
        scheduler.submit(text_job(2))
    assert refusals(scheduler, 2, "full") == 1 and list(scheduler._waiting) == [urgent, third, first]


def test_under_a_flood_of_background_requests_an_urgent_one_joins_the_full_batch_at_once():
    """Every row taken and the queue full of level-2 requests: the urgent request displaces one, and the next
    admission takes it into the headroom rows (and only it: the background requests wait for a row to free)."""
    scheduler = batcher(max_queue=16, max_rows=4, headroom_rows=2)
    lane = _Lane()
    lane.active = [text_job(2) for _ in range(4)]  # the rows are taken
    background = [scheduler.submit(text_job(2)) for _ in range(16)]
    urgent = scheduler.submit(text_job(0))
    assert scheduler._admit(lane) == [urgent]
    assert sum(job.future.done() for job in background) == 1  # the newest background request was refused
    lane.active = [*lane.active, urgent]
    assert scheduler._admit(lane) == []  # the headroom is the urgent requests' only
    defaults = [scheduler.submit(text_job(1)) for _ in range(2)]  # the default level is not urgent either
    assert scheduler._admit(lane) == [] and not any(job.future.done() for job in defaults)


def test_the_image_batcher_collects_the_urgent_images_first():
    scheduler = DynamicBatcher(SimpleNamespace(), "vit", 1, Metrics(), max_batch_size=2, max_queue_delay_ms=0,
                               max_queue=8, batching=True, priority=PriorityPolicy())
    pixels = np.zeros((1, 1, 4, 4), np.float32)
    jobs = [scheduler.submit(ImageJob(pixels=pixels, deadline=time.monotonic() + LATER, priority=p))
            for p in (2, 1, 0, 1)]
    assert scheduler._collect() == [jobs[2], jobs[1]]
    assert scheduler._collect() == [jobs[3], jobs[0]]


def test_the_settings_give_each_model_its_default_level():
    from service.models.kinds import priority_policy

    settings = Settings(default_priority="1,vit=0", priority_levels=4, priority_max_wait_s=3)
    vit, gpt = (priority_policy(SimpleNamespace(name=name), settings) for name in ("vit", "gpt"))
    assert (vit.default, gpt.default, gpt.levels, gpt.max_wait_s) == (0, 1, 4, 3)
    with pytest.raises(ValueError, match="TSERVE_DEFAULT_PRIORITY"):
        Settings(default_priority="gpt=4", priority_levels=4)
