"""Iteration-level (continuous) batching for the text models, after Orca (Yu et al., OSDI 2022) and
text-generation-inference's router.

A worker thread owns the decoding batch (ONNX Runtime never runs on the event loop). Each iteration admits waiting
requests at the step boundary (one prefill for the newcomers, their rows concatenated after the running rows),
retires the cancelled and expired ones, and runs one decoding step over every row (`TextBatch.generate_token`);
the scheduler reads only the step's `Generation`s. The queue in front is bounded (429 with Retry-After). A batch
holds at most `max_rows` rows; `workers` > 1 runs that many such loops (`_Lane`s) over one queue and one engine.

Invariant: a request's output does not depend on its batch or its lane (the searches see only their own rows'
logits, the engines mask padding slots), and every accepted request ends in a result or an explicit error: a
failure fails exactly the requests it concerns.

Design notes: docs/architecture.md, service/scheduling/continuous.py.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from service.errors import ServiceError
from service.observability.metrics import Metrics
from service.scheduling.jobs import Generation, TextJob
from service.scheduling.prefix_metrics import PrefixCacheMetrics
from service.scheduling.priority import PriorityPolicy
from service.scheduling.queueing import IDLE_WAIT_S, QueuedScheduler, fail, settle
from service.scheduling.speculation import SpeculationConfig
from service.scheduling.text_batch import DecodingBackend, TextBatch

log = logging.getLogger(__name__)

__all__ = ["ContinuousBatcher"]


class _ModeMetrics(NamedTuple):
    """The labelled children of the metrics observed per decoding mode, looked up once per mode (a `.labels()`
    lookup per step and request costs about as much as the observation itself)."""

    queue_wait: object
    time_to_first_token: object
    inter_token_latency: object
    generated_tokens: object


@dataclass(eq=False)
class _Lane:
    """One worker's decoding batch. `active`, `admitting` and `rows` are published under the scheduler's lock
    (replaced, never mutated); `batch` and `stepped_at` are the worker's own."""

    active: list[TextJob] = field(default_factory=list)
    admitting: list[TextJob] = field(default_factory=list)  # left the queue, prefill running, not active yet
    rows: int = 0  # the batch's live rows
    batch: TextBatch | None = None
    stepped_at: dict[TextJob, float] = field(default_factory=dict)  # when each running job was last stepped

    def held(self) -> int:
        """The rows its running requests hold, at their widest (beam width)."""
        return sum(job.rows for job in self.active)

    def load(self) -> int:
        """The rows this lane holds or is admitting (at their widest): what the lanes are balanced by."""
        return self.held() + sum(job.rows for job in self.admitting)


class ContinuousBatcher(QueuedScheduler):
    """The limits come from `service.settings` (`*_max_batch_rows`, `max_prefill_requests`, `max_queue_size`,
    `decoding_workers`)."""

    def __init__(self, backend: DecodingBackend, model: str, version: int, metrics: Metrics, *, max_rows: int,
                 max_prefill: int, max_queue: int, workers: int = 1, speculation: SpeculationConfig | None = None,
                 priority: PriorityPolicy = PriorityPolicy()):
        self.backend = backend
        self.max_rows = max_rows
        self.max_prefill = max_prefill
        self.speculation = speculation  # n-gram speculation for the batches' greedy rows (None: off)
        self._lanes = [_Lane() for _ in range(workers)]
        self._rows = 0  # the live rows of every lane's batch, published with `_active`
        super().__init__(model, version, metrics, max_queue, rows=lambda: self._rows, workers=workers,
                         priority=priority)
        # the children observed every iteration, and per mode (`_of_mode`), looked up once
        self._batch_size = metrics.batch_size.labels(**self.labels)
        self._batch_seconds = metrics.batch_seconds.labels(**self.labels)
        self._last_batch = metrics.last_batch.labels(**self.labels)
        self._prompt_tokens = metrics.prompt_tokens.labels(**self.labels)
        self._prefix_cache = PrefixCacheMetrics.of(backend, metrics, self.labels)
        self._by_mode: dict[str, _ModeMetrics] = {}
        # drafts, draft tokens and accepted tokens of speculative steps, declared at zero when speculation is on
        self._speculated = None if speculation is None else tuple(
            counter.labels(**self.labels) for counter in (metrics.spec_decode_drafts,
                                                          metrics.spec_decode_draft_tokens,
                                                          metrics.spec_decode_accepted_tokens))

    def _in_flight(self) -> list[TextJob]:
        return [job for lane in self._lanes for job in lane.admitting]

    def _forget_in_flight(self) -> None:
        for lane in self._lanes:
            lane.admitting = []

    # --- the worker threads -------------------------------------------------------------------------------

    def _run(self, worker: int) -> None:
        lane = self._lanes[worker]
        while True:
            with self._changed:
                if self._stop:
                    return
                if not lane.active and (not self._waiting or self._defers(lane)):
                    self._changed.wait(timeout=IDLE_WAIT_S)
                    continue
            try:
                self._iterate(lane)
            except Exception as error:  # the decoding step failed: every request of this batch is concerned
                log.exception("decoding step failed for %s", self.labels["model"])
                for job in lane.active:
                    fail(job.future, ServiceError(f"decoding failed: {error}"))
                lane.batch, lane.stepped_at = None, {}
                self._publish(lane, [])

    def _publish(self, lane: _Lane, active: list[TextJob], admitting: list[TextJob] | None = None) -> None:
        """Replace a lane's running set (and its set being admitted) under the lock, and the scheduler's union of
        them; nothing once stopped."""
        rows = lane.batch.live_rows if lane.batch is not None and active else 0
        with self._changed:
            if self._stop:
                return
            lane.active, lane.rows = active, rows
            if admitting is not None:
                lane.admitting = admitting
            self._active = [job for each in self._lanes for job in each.active]
            self._rows = sum(each.rows for each in self._lanes)

    def _defers(self, lane: _Lane) -> bool:
        """With `_changed` held: whether this idle lane leaves the waiting requests to an idle lane before it, which
        takes them: a load that one lane holds stays on one worker (its thread, its caches) instead of alternating
        between idle workers, each of whose calls would count as beside the other's for a while
        (`service.engines.runtime.EngineCalls`) and give up a thread. A busy first lane leaves them to the others."""
        index = self._lanes.index(lane)
        return any(not other.active and not other.admitting for other in self._lanes[:index])

    def _admit(self, lane: _Lane) -> list[TextJob]:
        """Take waiting requests in their order (`service.scheduling.priority`: level, then arrival) while the
        lane's batch stays within `max_rows` at every request's widest (its beam width; an urgent request may use the
        policy's headroom above it) and, with several lanes, while it stays within its share of all the rows (held,
        being admitted and waiting) or holds no more than any other lane."""
        rows = lane.held()
        admitted: list[TextJob] = []
        with self._changed:
            self._reorder()
            others, share = self._balance(lane) if self._waiting else (math.inf, math.inf)
            while self._waiting and len(admitted) < self.max_prefill:
                widest = self._waiting[0].rows
                if rows + widest > self.priority.row_limit(self._waiting[0], self.max_rows) and \
                        (lane.active or admitted):
                    break
                if rows + widest > share and rows > others:  # the emptier lanes take it
                    break
                admitted.append(self._waiting.popleft())
                rows += widest
            lane.admitting = admitted
            if admitted and self._waiting:
                self._changed.notify_all()  # lanes that deferred to this one (`_defers`) may take the rest
        self._retry.departed(len(admitted))
        return admitted

    def _balance(self, lane: _Lane) -> tuple[float, float]:
        """With `_changed` held: the fewest rows another lane holds, and a lane's share of every row held, being
        admitted or waiting -> (others, share); one lane: (inf, inf), it takes everything."""
        if len(self._lanes) == 1:
            return math.inf, math.inf
        others = min(each.load() for each in self._lanes if each is not lane)
        total = sum(each.load() for each in self._lanes) + sum(job.rows for job in self._waiting)
        return others, math.ceil(total / len(self._lanes))

    def _retire(self, lane: _Lane) -> None:
        """Drop cancelled and expired requests from the batch (their rows die, see `TextBatch.filter`)."""
        now = time.monotonic()
        live = [job for job in lane.active if not self._gone(job, now, "during decoding")]
        if len(live) != len(lane.active):
            lane.batch.filter(live)
            self._publish(lane, live)

    def _join(self, lane: _Lane, admitted: list[TextJob]) -> None:
        """Prefill the newcomers and append their rows to the batch. A prefill that raises fails the newcomers
        only; a newcomer whose first search step raises fails alone."""
        started = time.monotonic()
        for job in admitted:
            job.phases.admitted_at = started
        try:
            newcomers, generations = TextBatch.prefill(self.backend, admitted)
        except Exception as error:
            log.exception("prefill failed for %d request(s) of %s", len(admitted), self.labels["model"])
            for job in admitted:
                fail(job.future, ServiceError(f"prefill failed: {error}"))
            self._publish(lane, lane.active, admitting=[])
            return
        for job in admitted:
            self._of_mode(job.mode).queue_wait.observe(started - job.arrived)
            self._queue_waited(job, started)
            self._prompt_tokens.inc(len(job.input_ids))
        if self._prefix_cache is not None:
            self._prefix_cache.observe(admitted)
        joined = self._deliver(lane, generations, time.monotonic())
        newcomers.filter(joined)
        newcomers.speculation = self.speculation
        try:  # compaction (dropping dead rows) and the newcomers' join, in the batch's buffers when they have room
            lane.batch = newcomers if lane.batch is None else TextBatch.concatenate([lane.batch, newcomers])
        except Exception as error:
            log.exception("joining %d request(s) to the batch of %s failed", len(joined), self.labels["model"])
            for job in joined:
                fail(job.future, ServiceError(f"prefill failed: {error}"))
            joined = []
        self._publish(lane, lane.active + joined, admitting=[])

    def _iterate(self, lane: _Lane) -> None:
        self._retire(lane)
        with self._changed:
            self._leave_queue("while it waited in the queue")
        admitted = self._admit(lane)
        started = time.monotonic()
        if admitted:
            self._join(lane, admitted)
        if not lane.active:
            lane.batch, lane.stepped_at = None, {}
            return
        generations = lane.batch.generate_token()
        self._batch_size.observe(sum(g.rows for g in generations))
        self._observe_batch(started)
        survivors = self._deliver(lane, generations, time.monotonic())
        lane.stepped_at = {job: lane.stepped_at[job] for job in survivors}  # the others left the batch
        if len(survivors) != len(lane.active):
            lane.batch.filter(survivors)
            self._publish(lane, survivors)

    def _observe_batch(self, started: float) -> None:
        """The iteration's time (the newcomers' prompt pass and the step), and when it ended."""
        self._batch_seconds.observe(time.monotonic() - started)
        self._last_batch.set_to_current_time()

    def _deliver(self, lane: _Lane, generations: list[Generation], now: float) -> list[TextJob]:
        """Hand each request its step's generation (metrics, streamed tokens, its results when done); returns
        those that go on. A search or a stream callback that raised fails its own request only."""
        survivors = []
        for generation in generations:
            job = generation.job
            try:
                if generation.error is not None:
                    raise generation.error
                # a choice per row, and each draft token a speculative step kept
                self._of_mode(job.mode).generated_tokens.inc(generation.rows + generation.accepted)
                if generation.drafted:
                    self._count_draft(generation)
                self._after_step(lane, generation, now)
            except Exception as error:
                log.exception("decoding failed for one request of %s", self.labels["model"])
                fail(job.future, ServiceError(f"decoding failed: {error}"))
                continue
            if generation.done:
                job.phases.finished_at = now
                settle(job.future, generation.hypotheses)
            else:
                survivors.append(job)
        return survivors

    def _count_draft(self, generation: Generation) -> None:
        drafts, draft_tokens, accepted_tokens = self._speculated
        drafts.inc()
        draft_tokens.inc(generation.drafted)
        accepted_tokens.inc(generation.accepted)

    def _after_step(self, lane: _Lane, generation: Generation, now: float) -> None:
        job = generation.job
        if job.phases.first_token_at is None:
            job.phases.first_token_at = now
            self._of_mode(job.mode).time_to_first_token.observe(now - job.arrived)
        else:
            self._of_mode(job.mode).inter_token_latency.observe(now - lane.stepped_at[job])
        lane.stepped_at[job] = now
        if generation.token_ids:
            job.phases.generated += len(generation.token_ids)
            if job.on_tokens is not None:
                job.on_tokens(generation.token_ids, generation.logprobs)

    def _of_mode(self, mode: str) -> _ModeMetrics:
        """The metrics observed per decoding mode, labelled with this model's labels and `mode`."""
        children = self._by_mode.get(mode)
        if children is None:
            labels = {**self.labels, "mode": mode}
            children = self._by_mode[mode] = _ModeMetrics(
                *(metric.labels(**labels) for metric in (self.metrics.queue_wait, self.metrics.time_to_first_token,
                                                         self.metrics.inter_token_latency,
                                                         self.metrics.generated_tokens)))
        return children
