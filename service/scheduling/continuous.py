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
or an explicit error.
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
from service.errors import Cancelled, DeadlineExceeded, QueueFull, ServiceError, Unavailable
from service.metrics import Metrics

log = logging.getLogger(__name__)


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
        self._waiting: deque[TextJob] = deque()
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._accepting = True
        self._stop = False
        self._active: list[TextJob] = []
        self._seconds_per_job = 1.0  # moving averages for Retry-After
        self._jobs_per_batch = 1.0
        self._thread = threading.Thread(target=self._run, name=f"batcher-{model}", daemon=True)

    # --- the caller's side (event loop) -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: TextJob) -> TextJob:
        with self._lock:
            if not self._accepting:
                raise Unavailable("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{self.labels['model']} queue is full ({self.max_queue} waiting requests)",
                                self.retry_after())
            self._waiting.append(job)
            self.metrics.queue_depth.labels(**self.labels).set(len(self._waiting))
        self._wakeup.set()
        return job

    def retry_after(self) -> float:
        """Seconds until the queue has room, estimated from recent request durations and batch occupancy."""
        return len(self._waiting) * self._seconds_per_job / max(self._jobs_per_batch, 1.0)

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
        while (self._waiting or self._active) and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        self._stop = True
        self._wakeup.set()
        self._thread.join(timeout=5)
        for job in list(self._waiting) + self._active:
            self._fail(job, Unavailable("the server shut down before this request finished"))
        self._waiting.clear()

    # --- the worker thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        state = None
        while not self._stop:
            if not self._active and not self._waiting:
                self._wakeup.wait(timeout=0.1)
                self._wakeup.clear()
                continue
            try:
                state = self._iterate(state)
            except Exception as error:  # an engine failure: fail the batch, keep serving
                log.exception("decoding step failed for %s", self.labels["model"])
                for job in self._active:
                    self._fail(job, ServiceError(f"decoding failed: {error}"))
                self._active, state = [], None
            self.metrics.running_requests.labels(**self.labels).set(len(self._active))

    def _admit(self) -> list[TextJob]:
        rows = sum(len(job.pending.tokens) for job in self._active)  # live rows of the next step
        admitted = []
        now = time.monotonic()
        with self._lock:
            while self._waiting and len(admitted) < self.max_prefill:
                job = self._waiting[0]
                if job.cancelled.is_set() or now > job.deadline:
                    self._waiting.popleft()
                    self._fail(job, Cancelled("client went away") if job.cancelled.is_set()
                               else DeadlineExceeded("the request's deadline expired while it waited in the queue"))
                    continue
                widest = getattr(job.search, "num_beams", 1)  # the rows it will need after its first step
                if self._active and rows + widest > self.max_rows:
                    break
                self._waiting.popleft()
                admitted.append(job)
                rows += widest
            self.metrics.queue_depth.labels(**self.labels).set(len(self._waiting))
        return admitted

    def _retire(self) -> None:
        """Drop finished, cancelled and expired requests from the running set. Their rows stay in the batch as
        dead rows until the next compaction, so that a departure does not cost a copy of the whole cache."""
        now, live = time.monotonic(), []
        for job in self._active:
            if job.pending.done:
                self._complete(job)
            elif job.cancelled.is_set():
                self._fail(job, Cancelled("client went away"))
            elif now > job.deadline:
                self._fail(job, DeadlineExceeded("the request's deadline expired during decoding"))
            else:
                live.append(job)
        self._active = live

    def _live_rows(self) -> np.ndarray:
        """The batch rows of the running requests, in order (everything else is dead)."""
        if not self._active:
            return np.zeros(0, np.int64)
        return np.concatenate([np.arange(job.row_offset, job.row_offset + job.state_rows) for job in self._active])

    def _iterate(self, state):
        self._retire()
        admitted = self._admit()
        if admitted:
            started = time.monotonic()
            logits, new_state = self.backend.prefill([job.input_ids for job in admitted])
            keep = self._live_rows()
            # compaction (dropping dead rows) and the newcomers' join in one copy of the cache
            state = new_state if state is None or not len(keep) else \
                self.backend.concatenate([state, new_state], rows=[keep, None])
            offset = 0
            for job in self._active:
                job.row_offset, offset = offset, offset + job.state_rows
            for job, row in zip(admitted, logits):
                mode = {"model": self.labels["model"], "version": self.labels["version"], "mode": job.mode}
                self.metrics.queue_wait.labels(**mode).observe(started - job.arrived)
                self.metrics.prompt_tokens.labels(**self.labels).inc(len(job.input_ids))
                job.row_offset, job.state_rows = offset, 1  # its prefill row
                offset += 1
                job.pending = job.search.step(row[None])
                self.metrics.generated_tokens.labels(**self.labels, mode=job.mode).inc()  # its first token
                self._after_step(job, time.monotonic())
            self._active.extend(admitted)
            self._jobs_per_batch = 0.9 * self._jobs_per_batch + 0.1 * len(self._active)
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
        for job in self._active:
            n = job.state_rows
            job.pending = job.search.step(logits[job.row_offset : job.row_offset + n])
            self.metrics.generated_tokens.labels(**self.labels, mode=job.mode).inc(n)  # one choice per row
            self._after_step(job, now)
        return state

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
        hypotheses: list[Hypothesis] = job.search.results()
        self._seconds_per_job = 0.9 * self._seconds_per_job + 0.1 * (time.monotonic() - job.arrived)
        if not job.future.done():
            job.future.set_result(hypotheses)

    def _fail(self, job: TextJob, error: ServiceError) -> None:
        if isinstance(error, Cancelled):  # nobody reads a cancelled request's response: count it here
            self.metrics.failures.labels(**self.labels, reason=error.reason).inc()
        if not job.future.done():
            job.future.set_exception(error)
