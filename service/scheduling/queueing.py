"""What both schedulers need around their bounded queues: `QueuedScheduler` (the queue, admission, gauges and
stop they share), settling a request's future exactly once from any thread, the Retry-After estimate of a full
queue, and gauges that read the scheduler's own state.

`settle` / `fail` / `fail_if_gone` end a request; `RetryAfter` and `queue_full` make the one 429 of every route
that refuses work for want of room (`Retry-After` and `retry-after-ms` from one estimate, the measured rate at
which requests leave the queue); `bind_gauges` reads queue depth and running requests when Prometheus scrapes;
`Closing` says why a scheduler stops (`SHUTDOWN`, or its model version `unloading`).

Invariant: a future is settled once: the first outcome (the worker thread, `stop()` on another thread, or the
caller's cancel) wins and the others are ignored, never raised. A Retry-After is never longer than the refused
request itself may wait.

Design notes: docs/architecture.md, service/scheduling/queueing.py.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

from service.errors import (
    Cancelled,
    DeadlineExceeded,
    QueueFull,
    ServiceError,
    Unavailable,
    VersionUnloaded,
)
from service.observability.metrics import Metrics
from service.scheduling.priority import PriorityPolicy

IDLE_WAIT_S = 0.1  # an idle worker wakes at least this often (a submit wakes it at once)
DRAIN_POLL_S = 0.01  # how often stop() checks whether the accepted requests have finished
STOP_JOIN_S = 5.0  # how long stop() waits for the worker to leave a batch or step that is still running
# Weight of the newest sample in the moving average of the time between departures from the queue: about the
# last 10 departures count, so the estimate follows a change of load within a few batches.
DEPARTURE_SMOOTHING = 0.1
# Before anything has left the queue there is no rate: assume this many seconds between departures.
INITIAL_DEPARTURE_INTERVAL_S = 0.1
# retry-after-ms is spread over [estimate, (1 + RETRY_JITTER) x estimate]: a refused burst would otherwise retry in
# step
RETRY_JITTER = 1.0
MIN_RETRY_AFTER_S = 1  # the least Retry-After worth sending: 0 would tell the client to retry at once
MS_PER_S = 1000  # milliseconds per second: retry-after-ms and the queue delay count milliseconds


def retry_after_seconds(estimate_s: float, may_wait_s: float = math.inf) -> int:
    """The Retry-After header's whole seconds for an estimate: rounded up, at least MIN_RETRY_AFTER_S, and no
    more than the whole seconds the refused request may still wait (`may_wait_s`; infinite: no cap)."""
    cap = math.floor(may_wait_s) if math.isfinite(may_wait_s) else math.ceil(estimate_s)
    return max(MIN_RETRY_AFTER_S, min(math.ceil(estimate_s), cap))


def retry_after_ms(estimate_s: float, may_wait_s: float = math.inf) -> int:
    """OpenAI's `retry-after-ms` for an estimate: spread by up to RETRY_JITTER of itself, so that the clients
    refused together do not all come back at the same instant; at least 1 ms, at most what the refused request may
    still wait (`may_wait_s`)."""
    spread = estimate_s * (1 + RETRY_JITTER * random.random())
    return max(1, math.ceil(MS_PER_S * min(spread, may_wait_s)))  # at least 1 ms, as a wait just ending


def queue_full(message: str, estimate_s: float, may_wait_s: float) -> QueueFull:
    """The 429 of every route that refuses work for want of room, its retry hints both from `estimate_s` (the
    seconds until there is room) and both within what the refused request may still wait (`may_wait_s`): whole
    seconds in Retry-After (`retry_after_seconds`), milliseconds in retry-after-ms (`retry_after_ms`)."""
    return QueueFull(message, retry_after_seconds(estimate_s, may_wait_s), retry_after_ms(estimate_s, may_wait_s))


def settle(future: Future, result) -> bool:
    """Resolve `future` with `result` unless it already has an outcome; True if this call set it."""
    try:
        future.set_result(result)
    except InvalidStateError:
        return False
    return True


def fail(future: Future, error: ServiceError) -> bool:
    """Fail `future` with `error` unless it already has an outcome; True if this call set it."""
    try:
        future.set_exception(error)
    except InvalidStateError:
        return False
    return True


def fail_if_gone(future: Future, cancelled: bool, deadline: float, now: float, where: str) -> bool:
    """Fail a request whose client went away (Cancelled) or whose deadline passed (DeadlineExceeded, saying
    `where` it was: "while it waited in the queue", ...); True if it was either."""
    if cancelled:
        fail(future, Cancelled("client went away"))
    elif now > deadline:
        fail(future, DeadlineExceeded(f"the request's deadline expired {where}"))
    else:
        return False
    return True


@dataclass(frozen=True)
class Closing:
    """Why a scheduler stops: the error its requests get, with what a request submitted once it stopped accepting
    is told (`refused`) and what a request still waiting or running when the drain ended is told (`unfinished`)."""

    error: type[ServiceError]
    refused: str
    unfinished: str


SHUTDOWN = Closing(Unavailable, "the server is shutting down", "the server shut down before this request finished")


def unloading(model: str, version: int, drain_timeout_s: float) -> Closing:
    """A scheduler stopped because its model version is unloaded (model control) while the server serves on."""
    retry = "retry: a request that names no version goes to the model's active one"
    return Closing(VersionUnloaded, f"model {model!r} version {version} is being unloaded; {retry}",
                   f"model {model!r} version {version} was unloaded before this request finished (it was still "
                   f"running when the drain timeout, TSERVE_DRAIN_TIMEOUT_S={drain_timeout_s:g}, ended); {retry}")


class RetryAfter:
    """Seconds until a full queue (or a set of busy slots) has room for one more request, from the measured
    departure rate."""

    def __init__(self):
        self._interval = INITIAL_DEPARTURE_INTERVAL_S  # moving average of seconds between departures
        self._last: float | None = None
        self._lock = threading.Lock()

    def departed(self, count: int = 1, now: float | None = None) -> None:
        """`count` requests left the queue at `now` (one batch admission counts each of its requests)."""
        if count <= 0:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._last is not None:
                sample = (now - self._last) / count
                self._interval += DEPARTURE_SMOOTHING * (sample - self._interval)
            self._last = now

    def seconds(self, waiting: int, capacity: int, may_wait_s: float) -> int:
        """Whole seconds (`retry_after_seconds`) until `waiting` requests in a queue of `capacity` have drained
        by one, at the measured rate; capped at `may_wait_s`, the longest the request may wait."""
        return retry_after_seconds(self._estimate(waiting, capacity), may_wait_s)

    def milliseconds(self, waiting: int, capacity: int, may_wait_s: float) -> int:
        """The same estimate in milliseconds (`retry_after_ms`: OpenAI's `retry-after-ms`, spread), capped at
        `may_wait_s`."""
        return retry_after_ms(self._estimate(waiting, capacity), may_wait_s)

    def refusal(self, message: str, waiting: int, capacity: int, may_wait_s: float) -> QueueFull:
        """The 429 (`queue_full`) for a request refused while `waiting` requests hold a room for `capacity`
        (queued requests, or busy slots): room for it once they have drained by one, at the measured rate."""
        return queue_full(message, self._estimate(waiting, capacity), may_wait_s)

    def _estimate(self, waiting: int, capacity: int) -> float:
        return max(1, waiting - capacity + 1) * self._interval


_gauge_owners: dict[tuple[int, str, str], object] = {}  # (metrics, model, version) -> the scheduler bound


def bind_gauges(metrics: Metrics, labels: dict[str, str], waiting: Callable[[], int], running: Callable[[], int],
                rows: Callable[[], int] | None = None, owner: object = None) -> None:
    """Make the model's queue-depth / running-requests (/ batch-rows) gauges read the scheduler at scrape time."""
    metrics.queue_depth.labels(**labels).set_function(waiting)
    metrics.running_requests.labels(**labels).set_function(running)
    if rows is not None:
        metrics.batch_rows.labels(**labels).set_function(rows)
    _gauge_owners[(id(metrics), labels["model"], labels["version"])] = owner


def release_gauges(metrics: Metrics, labels: dict[str, str], owner: object, rows: bool = False) -> None:
    """A stopped scheduler's gauges read 0, and no longer hold it (nor its engine) alive; unless another scheduler
    for the same model version has bound them since (a version loaded again)."""
    key = (id(metrics), labels["model"], labels["version"])
    if _gauge_owners.get(key) is owner:
        bind_gauges(metrics, labels, lambda: 0, lambda: 0, (lambda: 0) if rows else None)
        del _gauge_owners[key]


class QueuedScheduler:
    """The skeleton both schedulers share: a bounded queue in front of its worker threads (one unless `workers`
    says more), admission (429 with Retry-After when full, 503 once stopping), the gauges, and a stop that drains
    what was accepted.

    Subclasses implement `_run(worker)` (worker number `worker`'s loop) and may widen `_in_flight` (requests that
    left the queue but are not running yet). `_changed` guards `_waiting`, `_active`, `_accepting` and `_stop` and is notified on every
    change the worker may wait for; `_active` is replaced, never mutated, under it.
    """

    def __init__(self, model: str, version: int, metrics: Metrics, max_queue: int,
                 rows: Callable[[], int] | None = None, workers: int = 1, priority: PriorityPolicy = PriorityPolicy()):
        if max_queue < 1:
            raise ValueError("max_queue must be >= 1")
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.labels = {"model": model, "version": str(version)}
        self.metrics = metrics
        self.max_queue = max_queue
        self.priority = priority  # the order of `_waiting` and who a full queue refuses
        self._changed = threading.Condition()
        self._waiting: deque = deque()
        self._active: list = []
        self._accepting = True
        self._closing = SHUTDOWN  # why it stops, once `stop` is called
        self._stop = False
        self._retry = RetryAfter()
        self._counts_rows = rows is not None
        bind_gauges(metrics, self.labels, waiting=lambda: len(self._waiting), running=lambda: len(self._active),
                    rows=rows, owner=self)
        self._threads = [threading.Thread(target=self._run, args=(worker,), daemon=True,
                                          name=f"batcher-{model}-{version}" + (f"-{worker}" if workers > 1 else ""))
                         for worker in range(workers)]

    # --- the caller's side (event loop) -------------------------------------------------------------------

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _working(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def submit(self, job):
        """Queue a request in its place (`service.scheduling.priority`); raises QueueFull (429, Retry-After) when the
        queue is full of requests at least as urgent, else refuses the least urgent waiting one in its favour;
        Unavailable when stopping."""
        with self._changed:
            if not self._accepting:
                raise self._closing.error(self._closing.refused)
            now = time.monotonic()
            if len(self._waiting) >= self.max_queue:
                message = f"{self.labels['model']} queue is full ({self.max_queue} waiting requests)"
                displaced = self.priority.displaced(self._waiting, job, now)
                if displaced is None:
                    self._count_refusal(job, "full")
                    raise self._retry.refusal(message, len(self._waiting), self.max_queue, job.deadline - now)
                self._waiting.remove(displaced)
                self._count_refusal(displaced, "displaced")
                fail(displaced.future, self._retry.refusal(
                    f"{message}: this request (priority {displaced.priority}) gave its place to a more urgent one "
                    f"(priority {job.priority})", len(self._waiting), self.max_queue, displaced.deadline - now))
            self._waiting.append(job)
            self._reorder()
            self._changed.notify_all()
        return job

    def _count_refusal(self, job, how: str) -> None:
        self.metrics.queue_refusals.labels(**self.labels, priority=str(job.priority), how=how).inc()

    def _reorder(self) -> None:
        """With `_changed` held: the waiting requests in the order they are served now (levels, then arrival; those
        that have waited `max_wait_s` first)."""
        if len(self._waiting) > 1:
            self._waiting = deque(self.priority.ordered(self._waiting, time.monotonic()))

    def _queue_waited(self, job, started: float) -> None:
        """Record how long `job` waited for its first batch, by its priority level."""
        self.metrics.priority_queue_wait.labels(**self.labels, priority=str(job.priority)).observe(
            started - job.arrived)

    def retry_after(self, may_wait_s: float = float("inf")) -> int:
        """Seconds until the queue has room for one more request (see `RetryAfter`)."""
        return self._retry.seconds(len(self._waiting), self.max_queue, may_wait_s)

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._active)

    def stop(self, timeout: float, closing: Closing = SHUTDOWN) -> None:
        """Stop accepting; let accepted requests finish for up to `timeout` seconds; fail whatever is left (503),
        each request told why (`closing`: the server shutting down, or the version unloaded)."""
        with self._changed:
            self._accepting = False
            self._closing = closing
            self._changed.notify_all()  # a batch being collected goes now: nothing more will arrive
        deadline = time.monotonic() + timeout
        while (self._waiting or self._in_flight() or self._active) and time.monotonic() < deadline \
                and self._working():
            time.sleep(DRAIN_POLL_S)
        with self._changed:
            self._stop = True
            self._changed.notify_all()
        join_by = time.monotonic() + STOP_JOIN_S
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=max(0.0, join_by - time.monotonic()))
        # If a join timed out that worker is inside a step: whatever it resolves later loses to these failures
        # (first outcome wins), and it publishes nothing once stopped.
        with self._changed:
            leftovers = list(self._waiting) + self._in_flight() + self._active
            self._waiting, self._active = deque(), []
            self._forget_in_flight()
        for job in leftovers:
            fail(job.future, closing.error(closing.unfinished))
        release_gauges(self.metrics, self.labels, owner=self, rows=self._counts_rows)

    # --- the worker's side --------------------------------------------------------------------------------

    def _run(self, worker: int) -> None:
        raise NotImplementedError

    def _in_flight(self) -> list:
        """Requests that left the queue and are not in `_active` yet (none unless a subclass says so)."""
        return []

    def _forget_in_flight(self) -> None:
        """Called by `stop` under the lock, after `_in_flight` was failed."""

    def _gone(self, job, now: float, where: str) -> bool:
        """Fail a request whose client went away or whose deadline passed; True if it was either."""
        return fail_if_gone(job.future, job.cancelled.is_set() or job.future.cancelled(), job.deadline, now, where)

    def _leave_queue(self, where: str) -> None:
        """With `_changed` held: fail the waiting requests that were cancelled or passed their deadline, wherever
        they are in the queue (not only at its head)."""
        now = time.monotonic()
        if all(not job.cancelled.is_set() and not job.future.cancelled() and now <= job.deadline
               for job in self._waiting):
            return
        kept = deque(job for job in self._waiting if not self._gone(job, now, where))
        self._retry.departed(len(self._waiting) - len(kept), now)
        self._waiting = kept
