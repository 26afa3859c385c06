"""Dynamic (request-level) batching for the image classifier, after Triton's dynamic batcher
(`max_batch_size` + `max_queue_delay_microseconds`).

One worker thread per model version owns the ONNX Runtime calls; nothing blocking runs on the event loop. The worker
takes the oldest waiting job, then keeps adding the next waiting jobs (in arrival order) until the batch holds
`max_batch_size` images, the next job would not fit, or `max_queue_delay_ms` has passed since the oldest job
arrived. A job's images are never split across batches, unless the job alone holds more than `max_batch_size`
images: then it runs alone, in chunks of `max_batch_size`. Each batch is one `engine.logits(...)` call whose rows
are sliced back to the jobs' futures. `batching=False` runs one job per call (the baseline benchmarks compare to).

The queue in front is bounded (429 with Retry-After). Every accepted job ends in logits or an explicit error:
expired or cancelled jobs are failed without running, an engine error fails only its batch, and `stop()` drains
what was accepted before failing leftovers with 503.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import numpy as np

from service.errors import ServiceError
from service.observability.metrics import Metrics
from service.scheduling.jobs import ImageJob
from service.scheduling.priority import PriorityPolicy
from service.scheduling.queueing import IDLE_WAIT_S, MS_PER_S, QueuedScheduler, fail, settle

log = logging.getLogger(__name__)

WHERE_QUEUED = "before its images were classified"  # where a request was when its deadline passed


class ImageBackend(Protocol):
    """What the batcher needs from an engine (`ViTEngine`)."""

    def logits(self, batch: np.ndarray) -> np.ndarray: ...


class DynamicBatcher(QueuedScheduler):
    """The limits come from `service.settings` (`vit_max_batch_size`, `vit_max_queue_delay_ms`, `max_queue_size`,
    `vit_batching`)."""

    def __init__(self, engine: ImageBackend, model: str, version: int, metrics: Metrics, *, max_batch_size: int,
                 max_queue_delay_ms: float, max_queue: int, batching: bool,
                 priority: PriorityPolicy = PriorityPolicy()):
        if max_batch_size < 1 or max_queue_delay_ms < 0:
            raise ValueError("max_batch_size must be >= 1 and max_queue_delay_ms >= 0")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_queue_delay = max_queue_delay_ms / MS_PER_S  # the clock counts seconds
        self.batching = batching
        super().__init__(model, version, metrics, max_queue, priority=priority)

    def cancel(self, job: ImageJob) -> None:
        """Drop a job that nobody waits for any more: out of the queue at once if it has not run."""
        job.cancel()
        with self._changed:
            self._changed.notify_all()

    # --- the worker thread --------------------------------------------------------------------------------

    def _run(self, worker: int = 0) -> None:  # one worker
        while True:
            batch = self._collect()
            if batch is None:
                return
            try:
                if len(batch) == 1 and batch[0].size > self.max_batch_size:
                    self._run_chunked(batch[0])
                else:
                    self._run_batch(batch)
            except Exception as error:  # an engine failure: fail this batch, keep serving
                log.exception("image batch failed for %s", self.labels["model"])
                for job in batch:
                    fail(job.future, ServiceError(f"inference failed: {error}"))
            with self._changed:
                self._active = []

    def _collect(self) -> list[ImageJob] | None:
        """Block until a batch is ready (see the module docstring); None when the batcher stops."""
        with self._changed:
            first = None
            while first is None:
                if self._stop:
                    return None
                self._leave_queue(WHERE_QUEUED)
                first = self._pop_live()
                if first is None:  # the queue is empty: nothing can expire until a submit wakes the worker
                    self._changed.wait(timeout=IDLE_WAIT_S)
            batch, images = [first], first.size
            if self.batching:
                flush_at = first.arrived + self.max_queue_delay
                while images < self.max_batch_size and not self._stop:
                    job = self._pop_live(fits=self.max_batch_size - images)
                    if job is not None:
                        batch.append(job)
                        images += job.size
                        continue
                    remaining = flush_at - time.monotonic()
                    if self._waiting or remaining <= 0 or not self._accepting:
                        break  # the next job does not fit, the delay is over, or nothing more will come
                    self._changed.wait(timeout=remaining)
            self._active = batch  # set under the lock, so stop() never sees a batch in neither place
            self._retry.departed(len(batch))
            return batch

    def _pop_live(self, fits: int | None = None) -> ImageJob | None:
        """The first waiting job in order (`service.scheduling.priority`: level, then arrival) that can still run
        (holding at most `fits` images), failing dead ones on the way."""
        self._reorder()
        while self._waiting:
            job = self._waiting[0]
            if self._dead(job):
                self._waiting.popleft()
                self._retry.departed()
                continue
            if fits is not None and job.size > fits:
                return None
            return self._waiting.popleft()
        return None

    def _dead(self, job: ImageJob) -> bool:
        """Fail a job that was cancelled or expired; True if it was."""
        return self._gone(job, time.monotonic(), WHERE_QUEUED)

    def _run_batch(self, batch: list[ImageJob]) -> None:
        batch = [job for job in batch if not self._dead(job)]  # may have expired during the queue delay
        if not batch:
            return
        started = time.monotonic()
        self._observe_start(batch, started)
        pixels = np.concatenate([job.pixels for job in batch]) if len(batch) > 1 else batch[0].pixels
        logits = self._infer(pixels)  # (B, classes)
        offset = 0
        for job in batch:
            self._complete(job, logits[offset : offset + job.size])
            offset += job.size

    def _run_chunked(self, job: ImageJob) -> None:
        """A job larger than max_batch_size: alone, in chunks of max_batch_size, checking its deadline between."""
        started = time.monotonic()
        self._observe_start([job], started)
        parts = []
        for start in range(0, job.size, self.max_batch_size):
            if start and self._dead(job):
                return
            parts.append(self._infer(job.pixels[start : start + self.max_batch_size]))
        self._complete(job, np.concatenate(parts))

    def _infer(self, pixels: np.ndarray) -> np.ndarray:
        started = time.monotonic()
        logits = np.asarray(self.engine.logits(pixels), dtype=np.float32)
        if logits.ndim != 2 or len(logits) != len(pixels):
            raise ValueError(f"engine returned logits of shape {logits.shape} for {len(pixels)} images")
        self.metrics.batch_size.labels(**self.labels).observe(len(pixels))
        self.metrics.batch_seconds.labels(**self.labels).observe(time.monotonic() - started)
        self.metrics.last_batch.labels(**self.labels).set_to_current_time()
        return logits

    def _observe_start(self, jobs: list[ImageJob], started: float) -> None:
        images = min(sum(job.size for job in jobs), self.max_batch_size)  # a chunked job: its chunks' size
        for job in jobs:
            job.phases.started_at, job.phases.batch_size = started, images
            self.metrics.queue_wait.labels(**self.labels, mode=job.mode).observe(started - job.arrived)
            self._queue_waited(job, started)

    def _complete(self, job: ImageJob, logits: np.ndarray) -> None:
        self.metrics.images.labels(**self.labels).inc(job.size)
        job.phases.finished_at = time.monotonic()
        settle(job.future, logits.copy())  # a no-op if the caller gave up (deadline or disconnect) meanwhile
