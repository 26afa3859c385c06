"""Iteration-level (continuous) batching for the text models, after Orca (Yu et al., OSDI 2022) and
text-generation-inference's router.

One worker thread per model owns the decoding batch; ONNX Runtime never runs on the event loop. Each iteration:
1. admit waiting requests at the step boundary: one prefill (prompt pass, or encoder pass + start token) for the
   newcomers, whose rows are concatenated after the running rows;
2. retire requests that finished, were cancelled (client gone) or passed their deadline: their rows are not
   selected for the next step, so they are freed within one step;
3. one decoding step over every row of every running request (a request's beams are rows of the batch); each
   request's search picks its next tokens and which of its rows continue (`parents`), and the batch rows are
   re-selected accordingly.

A request's output does not depend on its batch: the searches see only their own rows' logits, and the engines
mask padding slots. The queue in front is bounded (429 with Retry-After); every accepted request ends in a result
or an explicit error, and a failure fails exactly the requests it concerns: a prefill that raises fails its
newcomers (the running batch goes on), a search that raises fails its own request, and only a decoding step that
raises fails the whole batch (its cache is then unusable). The batch never holds more than `max_rows` rows (a
request counts with its widest row count, its beam width), except that an empty batch takes one request wider
than that rather than none. Waiting requests that were cancelled or passed their deadline leave the queue at the
next step boundary, wherever they are in it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from service.decoding import Hypothesis, Search, StepResult
from service.errors import QueueFull, ServiceError, Unavailable
from service.metrics import Metrics
from service.scheduling.queueing import (
    RetryAfter,
    bind_gauges,
    fail,
    fail_if_gone,
    release_gauges,
    settle,
)

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.1  # an idle worker wakes at least this often (a submit wakes it at once)
DRAIN_POLL_S = 0.02  # how often stop() checks whether the accepted requests have finished
STOP_JOIN_S = 5.0  # how long stop() waits for the worker to leave a step that is still running


class DecodingBackend(Protocol):
    """What the scheduler needs from an engine (`GPTEngine`, `TranslationEngine`)."""

    def prefill(self, inputs: Sequence[Sequence[int]]) -> tuple[np.ndarray, Any]: ...

    def step(self, state: Any, tokens: np.ndarray) -> np.ndarray: ...

    def select(self, state: Any, rows: np.ndarray) -> Any: ...

    def concatenate(self, states: Sequence[Any], rows: Sequence[np.ndarray | None] | None = None) -> Any: ...


@dataclass(eq=False)
class TextJob:
    """One request inside the scheduler. `on_tokens(new_ids)` (optional, called on the worker thread) receives
    the tokens of a single-row search as they are generated; `future` resolves to the search's hypotheses."""

    input_ids: list[int]
    search: Search
    mode: str  # greedy | beam | sample
    deadline: float  # time.monotonic() seconds
    on_tokens: Callable[[list[int]], None] | None = None
    future: Future = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # scheduler bookkeeping
    pending: StepResult | None = None
    row_offset: int = 0  # its first row in the batch
    state_rows: int = 0  # how many rows of the batch it holds
    streamed: int = 0
    first_token_at: float | None = None
    last_step_at: float | None = None
    # phase boundaries (time.monotonic()) for the tracing spans, which the serving layer creates afterwards
    admitted_at: float | None = None  # left the queue: its prefill starts
    finished_at: float | None = None  # its results were collected

    def cancel(self) -> None:
        """Ask the scheduler to drop this request; its rows are freed at the next step boundary."""
        self.cancelled.set()


class ContinuousBatcher:
    def __init__(self, backend: DecodingBackend, model: str, version: int, metrics: Metrics, max_rows: int = 64,
                 max_prefill: int = 16, max_queue: int = 256):
        self.backend = backend
        self.labels = {"model": model, "version": str(version)}
        self.metrics = metrics
        self.max_rows = max_rows
        self.max_prefill = max_prefill
        self.max_queue = max_queue
        self._lock = threading.Lock()  # guards _waiting, _admitting, _active and _accepting
        self._waiting: deque[TextJob] = deque()
        self._admitting: list[TextJob] = []  # left the queue, prefill running, not active yet
        self._active: list[TextJob] = []  # replaced (never mutated) under the lock by the worker
        self._wakeup = threading.Event()
        self._accepting = True
        self._stop = threading.Event()
        self._retry = RetryAfter()
        bind_gauges(metrics, self.labels, waiting=lambda: len(self._waiting), running=lambda: len(self._active),
                    rows=lambda: sum(job.state_rows for job in self._active), owner=self)
        self._thread = threading.Thread(target=self._run, name=f"batcher-{model}", daemon=True)

    # --- the caller's side (event loop) -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: TextJob) -> TextJob:
        with self._lock:
            if not self._accepting:
                raise Unavailable("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                may_wait = job.deadline - time.monotonic()
                raise QueueFull(f"{self.labels['model']} queue is full ({self.max_queue} waiting requests)",
                                self._retry.seconds(len(self._waiting), self.max_queue, may_wait),
                                self._retry.milliseconds(len(self._waiting), self.max_queue, may_wait))
            self._waiting.append(job)
        self._wakeup.set()
        return job

    def retry_after(self, may_wait_s: float = float("inf")) -> int:
        """Seconds until the queue has room for one more request (see `RetryAfter`)."""
        return self._retry.seconds(len(self._waiting), self.max_queue, may_wait_s)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._active)

    def stop(self, timeout: float) -> None:
        """Stop accepting; let accepted requests finish for up to `timeout` seconds; fail whatever is left."""
        with self._lock:
            self._accepting = False
        deadline = time.monotonic() + timeout
        while (self._waiting or self._admitting or self._active) and time.monotonic() < deadline \
                and self._thread.is_alive():
            time.sleep(DRAIN_POLL_S)
        self._stop.set()
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout=STOP_JOIN_S)
        # If the join timed out the worker is inside a step: whatever it resolves later loses to these failures
        # (first outcome wins), and it publishes nothing once stopped.
        with self._lock:
            leftovers = list(self._waiting) + self._admitting + self._active
            self._waiting, self._admitting, self._active = deque(), [], []
        for job in leftovers:
            fail(job.future, Unavailable("the server shut down before this request finished"))
        release_gauges(self.metrics, self.labels, owner=self, rows=True)

    # --- the worker thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        state = None
        while not self._stop.is_set():
            if not self._active and not self._waiting:
                self._wakeup.wait(timeout=IDLE_WAIT_S)
                self._wakeup.clear()
                continue
            try:
                state = self._iterate(state)
            except Exception as error:  # the decoding step failed: every running request is concerned
                log.exception("decoding step failed for %s", self.labels["model"])
                for job in self._active:
                    fail(job.future, ServiceError(f"decoding failed: {error}"))
                self._publish([])
                state = None

    def _publish(self, active: list[TextJob], admitting: list[TextJob] | None = None) -> None:
        """Replace the running set (and the set being admitted) under the lock; nothing once stopped."""
        with self._lock:
            if self._stop.is_set():
                return
            self._active = active
            if admitting is not None:
                self._admitting = admitting

    def _leave_queue(self) -> None:
        """Fail the waiting requests that were cancelled or passed their deadline, wherever they are in the queue."""
        now = time.monotonic()
        with self._lock:
            if all(not job.cancelled.is_set() and now <= job.deadline for job in self._waiting):
                return
            kept = deque(job for job in self._waiting if not fail_if_gone(
                job.future, job.cancelled.is_set(), job.deadline, now, "while it waited in the queue"))
            self._retry.departed(len(self._waiting) - len(kept), now)
            self._waiting = kept

    def _admit(self) -> list[TextJob]:
        """Take waiting requests, oldest first, while the batch stays within `max_rows` at every request's widest."""
        rows = sum(self._widest(job) for job in self._active)
        admitted: list[TextJob] = []
        with self._lock:
            while self._waiting and len(admitted) < self.max_prefill:
                widest = self._widest(self._waiting[0])
                if rows + widest > self.max_rows and (self._active or admitted):
                    break
                admitted.append(self._waiting.popleft())
                rows += widest
            self._admitting = admitted
        self._retry.departed(len(admitted))
        return admitted

    @staticmethod
    def _widest(job: TextJob) -> int:
        """The most rows the request can hold at once: its beam width (1 for greedy and sampling)."""
        return getattr(job.search, "num_beams", 1)

    def _retire(self) -> None:
        """Drop finished, cancelled and expired requests from the running set. Their rows stay in the batch as
        dead rows until the next compaction, so that a departure does not cost a copy of the whole cache."""
        now, live = time.monotonic(), []
        for job in self._active:
            if job.pending.done:
                self._complete(job)
            elif not fail_if_gone(job.future, job.cancelled.is_set(), job.deadline, now, "during decoding"):
                live.append(job)
        if len(live) != len(self._active):
            self._publish(live)

    def _live_rows(self) -> np.ndarray:
        """The batch rows of the running requests, in order (everything else is dead)."""
        if not self._active:
            return np.zeros(0, np.int64)
        return np.concatenate([np.arange(job.row_offset, job.row_offset + job.state_rows) for job in self._active])

    def _join(self, state, admitted: list[TextJob]):
        """Prefill the newcomers and append their rows to the batch; returns the new batch state. A prefill that
        raises fails the newcomers only; a newcomer whose first search step raises fails alone (its row is dead)."""
        started = time.monotonic()
        for job in admitted:
            job.admitted_at = started
        try:
            logits, new_state = self.backend.prefill([job.input_ids for job in admitted])
            keep = self._live_rows()
            # compaction (dropping dead rows) and the newcomers' join in one copy of the cache
            joined = new_state if state is None or not len(keep) else \
                self.backend.concatenate([state, new_state], rows=[keep, None])
        except Exception as error:
            log.exception("prefill failed for %d request(s) of %s", len(admitted), self.labels["model"])
            for job in admitted:
                fail(job.future, ServiceError(f"prefill failed: {error}"))
            self._publish(self._active, admitting=[])
            return state
        offset = 0
        for job in self._active:
            job.row_offset, offset = offset, offset + job.state_rows
        now, joined_jobs = time.monotonic(), []
        for job, row in zip(admitted, logits):
            mode = {"model": self.labels["model"], "version": self.labels["version"], "mode": job.mode}
            self.metrics.queue_wait.labels(**mode).observe(started - job.arrived)
            self.metrics.prompt_tokens.labels(**self.labels).inc(len(job.input_ids))
            job.row_offset, job.state_rows = offset, 1  # its prefill row
            offset += 1
            if self._advance(job, row[None], now):
                joined_jobs.append(job)
        self._publish(self._active + joined_jobs, admitting=[])
        return joined

    def _iterate(self, state):
        self._retire()
        self._leave_queue()
        admitted = self._admit()
        if admitted:
            state = self._join(state, admitted)
            self._retire()  # a newcomer may be done on its first token
        if not self._active:
            return None

        # Plan the step. If every request keeps its row count and few rows are dead, rows stay where they are
        # (reordered in place, dead rows fed a pad token); otherwise the batch is compacted in one gather.
        R = state.rows
        dead = R - sum(job.state_rows for job in self._active)
        in_place = dead <= R // 4 and all(len(job.pending.tokens) == job.state_rows for job in self._active)
        if in_place:
            parents, tokens = np.arange(R), np.zeros(R, np.int64)
            for job in self._active:
                rows = slice(job.row_offset, job.row_offset + job.state_rows)
                parents[rows], tokens[rows] = job.pending.parents + job.row_offset, job.pending.tokens
            if dead:
                state.positions[np.setdiff1d(np.arange(R), self._live_rows())] = 0  # garbage rows, valid positions
        else:
            parents = np.concatenate([job.pending.parents + job.row_offset for job in self._active])
            tokens = np.concatenate([job.pending.tokens for job in self._active])
            offset = 0
            for job in self._active:
                job.row_offset, job.state_rows = offset, len(job.pending.tokens)
                offset += job.state_rows
        state = self.backend.select(state, parents)
        logits = self.backend.step(state, tokens)  # (rows, V)
        self.metrics.batch_size.labels(**self.labels).observe(R - dead if in_place else len(tokens))
        now = time.monotonic()
        survivors = [job for job in self._active
                     if self._advance(job, logits[job.row_offset : job.row_offset + job.state_rows], now)]
        if len(survivors) != len(self._active):
            self._publish(survivors)
        return state

    def _advance(self, job: TextJob, logits: np.ndarray, now: float) -> bool:
        """Give the request's search the logits of its rows; False (and the request failed) if the search or the
        stream callback raised: that fails this request only."""
        try:
            job.pending = job.search.step(logits)
            self.metrics.generated_tokens.labels(**self.labels, mode=job.mode).inc(len(logits))  # a choice a row
            self._after_step(job, now)
        except Exception as error:
            log.exception("decoding failed for one request of %s", self.labels["model"])
            fail(job.future, ServiceError(f"decoding failed: {error}"))
            return False
        return True

    def _after_step(self, job: TextJob, now: float) -> None:
        mode = {"model": self.labels["model"], "version": self.labels["version"], "mode": job.mode}
        if job.first_token_at is None:
            job.first_token_at = now
            self.metrics.time_to_first_token.labels(**mode).observe(now - job.arrived)
        else:
            self.metrics.inter_token_latency.labels(**mode).observe(now - job.last_step_at)
        job.last_step_at = now
        if job.on_tokens is not None:
            generated = job.search.generated  # single-row searches only (greedy, sampling)
            if len(generated) > job.streamed:
                job.on_tokens(generated[job.streamed :].tolist())
                job.streamed = len(generated)

    def _complete(self, job: TextJob) -> None:
        job.finished_at = time.monotonic()
        try:
            hypotheses: list[Hypothesis] = job.search.results()
        except Exception as error:
            log.exception("collecting the results failed for one request of %s", self.labels["model"])
            fail(job.future, ServiceError(f"decoding failed: {error}"))
            return
        settle(job.future, hypotheses)
