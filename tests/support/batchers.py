"""The continuous batcher over the fake backend, as the scheduler tests drive it: the settings' limits, a text job,
and a running request held at a step (the backend's gate closed) so that a test acts between two steps."""

from __future__ import annotations

import time

from service.decoding import GreedySearch
from service.observability.metrics import Metrics
from service.scheduling.continuous import ContinuousBatcher
from service.scheduling.jobs import TextJob
from service.settings import Settings
from tests.support.fake_decoding import FakeBackend
from tests.support.waiting import PATIENCE_S

DEFAULTS = Settings.model_construct()  # the declared defaults, without reading the environment
LIMITS = {"max_rows": DEFAULTS.gpt_max_batch_rows, "max_prefill": DEFAULTS.max_prefill_requests,
          "max_queue": DEFAULTS.max_queue_size}
JOB_TIMEOUT_S = 30.0  # a deadline no test reaches unless it sets one
STEP_WAIT_S = PATIENCE_S  # how long a test waits for the worker to enter a step
HELD_TOKENS = 200  # a held request's length: it cannot finish while a test acts


class BatcherFactory:
    """`make(backend=None, start=True, **limits)` -> a `ContinuousBatcher` named "m" version 1 on the fake backend;
    `close()` opens every backend's gate and stops every batcher made."""

    def __init__(self):
        self.made: list[ContinuousBatcher] = []

    def __call__(self, backend=None, start: bool = True, **options) -> ContinuousBatcher:
        b = ContinuousBatcher(backend or FakeBackend(), "m", 1, Metrics(), **{**LIMITS, **options})
        if start:
            b.start()
        self.made.append(b)
        return b

    def close(self) -> None:
        for b in self.made:
            b.backend.gate.set()
            b.stop(timeout=STEP_WAIT_S)


def job(prompt, search, timeout: float = JOB_TIMEOUT_S, **extra) -> TextJob:
    return TextJob(list(prompt), search, "x", time.monotonic() + timeout, **extra)


def hold(b: ContinuousBatcher, max_new: int = HELD_TOKENS) -> TextJob:
    """A long greedy request that is running, with the backend's gate closed: the next step waits for the test."""
    b.backend.gate.clear()
    b.backend.in_step.clear()
    running = b.submit(job([1, 2], GreedySearch(max_new, None)))
    assert b.backend.in_step.wait(timeout=STEP_WAIT_S)
    return running
