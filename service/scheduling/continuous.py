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
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from service.decoding import Hypothesis, Search
from service.errors import ServiceError
from service.observability.metrics import Metrics
from service.scheduling.queueing import IDLE_WAIT_S, QueuedScheduler, fail, settle
from service.scheduling.text_batch import DecodingBackend, Outcome, TextBatch

log = logging.getLogger(__name__)

__all__ = ["ContinuousBatcher", "DecodingBackend", "TextJob"]


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
    # scheduler bookkeeping (the rows are the batch's, `TextBatch`)
    streamed: int = 0
    first_token_at: float | None = None
    last_step_at: float | None = None
    # phase boundaries (time.monotonic()) for the tracing spans, which the serving layer creates afterwards
    admitted_at: float | None = None  # left the queue: its prefill starts
    finished_at: float | None = None  # its results were collected

    def cancel(self) -> None:
        """Ask the scheduler to drop this request; its rows are freed at the next step boundary."""
        self.cancelled.set()


class ContinuousBatcher(QueuedScheduler):
    def __init__(self, backend: DecodingBackend, model: str, version: int, metrics: Metrics, max_rows: int = 64,
                 max_prefill: int = 16, max_queue: int = 256):
        self.backend = backend
        self.max_rows = max_rows
        self.max_prefill = max_prefill
        self._admitting: list[TextJob] = []  # left the queue, prefill running, not active yet
        self._rows = 0  # the batch's live rows, published with `_active`
        self._batch: TextBatch | None = None  # the worker's own
        super().__init__(model, version, metrics, max_queue, rows=lambda: self._rows)

    def _in_flight(self) -> list[TextJob]:
        return self._admitting

    def _forget_in_flight(self) -> None:
        self._admitting = []

    # --- the worker thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._changed:
                if self._stop:
                    return
                if not self._active and not self._waiting:
                    self._changed.wait(timeout=IDLE_WAIT_S)
                    continue
            try:
                self._iterate()
            except Exception as error:  # the decoding step failed: every running request is concerned
                log.exception("decoding step failed for %s", self.labels["model"])
                for job in self._active:
                    fail(job.future, ServiceError(f"decoding failed: {error}"))
                self._batch = None
                self._publish([])

    def _publish(self, active: list[TextJob], admitting: list[TextJob] | None = None) -> None:
        """Replace the running set (and the set being admitted) under the lock; nothing once stopped."""
        rows = self._batch.live_rows if self._batch is not None and active else 0
        with self._changed:
            if self._stop:
                return
            self._active, self._rows = active, rows
            if admitting is not None:
                self._admitting = admitting

    def _admit(self) -> list[TextJob]:
        """Take waiting requests, oldest first, while the batch stays within `max_rows` at every request's widest
        (its beam width)."""
        rows = sum(job.search.max_rows for job in self._active)
        admitted: list[TextJob] = []
        with self._changed:
            while self._waiting and len(admitted) < self.max_prefill:
                widest = self._waiting[0].search.max_rows
                if rows + widest > self.max_rows and (self._active or admitted):
                    break
                admitted.append(self._waiting.popleft())
                rows += widest
            self._admitting = admitted
        self._retry.departed(len(admitted))
        return admitted

    def _retire(self) -> None:
        """Drop finished, cancelled and expired requests from the batch (their rows die, see `TextBatch.filter`)."""
        now, live = time.monotonic(), []
        for job in self._active:
            if self._batch.pending[job].done:
                self._complete(job)
            elif not self._gone(job, now, "during decoding"):
                live.append(job)
        if len(live) != len(self._active):
            self._batch.filter(live)
            self._publish(live)

    def _join(self, admitted: list[TextJob]) -> None:
        """Prefill the newcomers and append their rows to the batch. A prefill that raises fails the newcomers
        only; a newcomer whose first search step raises fails alone."""
        started = time.monotonic()
        for job in admitted:
            job.admitted_at = started
        try:
            newcomers, outcomes = TextBatch.prefill(self.backend, admitted)
        except Exception as error:
            log.exception("prefill failed for %d request(s) of %s", len(admitted), self.labels["model"])
            for job in admitted:
                fail(job.future, ServiceError(f"prefill failed: {error}"))
            self._publish(self._active, admitting=[])
            return
        for job in admitted:
            mode = {"model": self.labels["model"], "version": self.labels["version"], "mode": job.mode}
            self.metrics.queue_wait.labels(**mode).observe(started - job.arrived)
            self.metrics.prompt_tokens.labels(**self.labels).inc(len(job.input_ids))
        joined = self._deliver(newcomers, outcomes, time.monotonic())
        newcomers.filter(joined)
        try:  # compaction (dropping dead rows) and the newcomers' join in one copy of the caches
            self._batch = newcomers if self._batch is None else TextBatch.concatenate([self._batch, newcomers])
        except Exception as error:
            log.exception("joining %d request(s) to the batch of %s failed", len(joined), self.labels["model"])
            for job in joined:
                fail(job.future, ServiceError(f"prefill failed: {error}"))
            joined = []
        self._publish(self._active + joined, admitting=[])

    def _iterate(self) -> None:
        self._retire()
        with self._changed:
            self._leave_queue("while it waited in the queue")
        admitted = self._admit()
        if admitted:
            self._join(admitted)
            self._retire()  # a newcomer may be done on its first token
        if not self._active:
            self._batch = None
            return
        batch = self._batch
        fed = sum(len(batch.pending[job].tokens) for job in batch.jobs)
        outcomes = batch.generate_token()
        self.metrics.batch_size.labels(**self.labels).observe(fed)
        survivors = self._deliver(batch, outcomes, time.monotonic())
        if len(survivors) != len(self._active):
            batch.filter(survivors)
            self._publish(survivors)

    def _deliver(self, batch: TextBatch, outcomes: list[Outcome], now: float) -> list[TextJob]:
        """Hand each request its step's outcome (metrics, streamed tokens); returns those that go on. A search or a
        stream callback that raised fails its own request only."""
        survivors = []
        for job, outcome in zip(batch.jobs, outcomes):
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                rows = batch.spans[job][1]  # a choice per row it held
                self.metrics.generated_tokens.labels(**self.labels, mode=job.mode).inc(rows)
                self._after_step(job, now)
            except Exception as error:
                log.exception("decoding failed for one request of %s", self.labels["model"])
                fail(job.future, ServiceError(f"decoding failed: {error}"))
                continue
            survivors.append(job)
        return survivors

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
