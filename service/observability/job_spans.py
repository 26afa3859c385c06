"""The trace spans of a request's scheduler jobs (`service.observability.tracing` switches tracing on and hands these
out: `tracing.text_spans`, `tracing.image_spans`).

- per text job (one per prompt and choice, or per text to translate; `tserve.job` = its index in the request):
  `queue_wait` (arrival to admission into the batch), `prefill` (admission to its first token) and `decode` (first
  token to its end), with `tserve.model`, `tserve.version`, `tserve.mode`, `tserve.rows` (the rows it held in the
  batch: its beam width), `tserve.prompt_tokens` and `tserve.generated_tokens`;
- per image job: `queue_wait` and `inference` (`tserve.images`: the request's, `tserve.batch_size`: the batch's).
A job that failed or was given up ends its last phase (at the moment it was seen) with status ERROR.

The schedulers' worker threads create no spans: they only stamp the phase boundaries on the job (time.monotonic():
`arrived`, then `job.phases`, `service.scheduling.jobs`), and the serving layer creates the child spans afterwards,
on the event loop, with those times converted to epoch nanoseconds by the clock tracing took at setup, so that a
request's spans nest and order exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from opentelemetry import context as otel_context
from opentelemetry.trace import Status, StatusCode, Tracer

class Off:
    """What `tracing.text_spans` / `tracing.image_spans` return while tracing is off: does nothing."""

    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def record(self, error: BaseException | None = None) -> None:
        pass


OFF = Off()


class JobSpans:
    """The phase spans of a request's scheduler jobs, created once the request's wait for them is over: on leaving
    `with` (given the error that ended the wait, if any), or by `record()`. The parent is the span current when
    this was made (the request's), whenever `record` runs. `current()` is the tracer then (None: tracing was
    switched off meanwhile, nothing is recorded); `epoch_ns` converts the jobs' time.monotonic() stamps."""

    def __init__(self, current: Callable[[], Tracer | None], epoch_ns: Callable[[float], int], loaded,
                 jobs: Sequence, image: bool):
        self.current, self.epoch_ns = current, epoch_ns
        self.loaded, self.jobs, self.image = loaded, jobs, image
        self.parent = otel_context.get_current()
        self.recorded = False

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        self.record(error)
        return False

    def record(self, error: BaseException | None = None) -> None:
        """Create the spans (once); `error`: what ended the request's wait, for jobs left unfinished."""
        tracer = self.current()
        if self.recorded or tracer is None:
            return
        self.recorded = True
        now = time.monotonic()
        base = {"tserve.model": self.loaded.name, "tserve.version": self.loaded.version}
        for index, job in enumerate(self.jobs):
            attributes = dict(base)
            failure = _failure(job.future, error)
            phases = job.phases
            if self.image:
                attributes.update({"tserve.mode": job.mode, "tserve.images": job.size})
                boundaries = [("queue_wait", job.arrived, phases.started_at, {}),
                              ("inference", phases.started_at, phases.finished_at,
                               {"tserve.batch_size": phases.batch_size})]
            else:
                generated = _generated_tokens(job, failure)
                attributes.update({"tserve.job": index, "tserve.mode": job.mode, "tserve.rows": job.rows,
                                   "tserve.prompt_tokens": len(job.input_ids)})
                if generated is not None:
                    attributes["tserve.generated_tokens"] = generated
                boundaries = [("queue_wait", job.arrived, phases.admitted_at, {}),
                              ("prefill", phases.admitted_at, phases.first_token_at, {}),
                              ("decode", phases.first_token_at, phases.finished_at, {})]
            self._phase_spans(tracer, boundaries, attributes, failure, now)

    def _phase_spans(self, tracer: Tracer, phases, attributes: dict, failure, now: float) -> None:
        """One span per phase that started, each from its start to the next boundary; the last one ends at its own
        end, or `now` when the job never got there, and carries the failure."""
        started = [(name, start, end, extra) for name, start, end, extra in phases if start is not None]
        for i, (name, start, end, extra) in enumerate(started):
            last = i == len(started) - 1
            span = tracer.start_span(name, context=self.parent, attributes={**attributes, **extra},
                                     start_time=self.epoch_ns(start))
            if last and failure is not None:
                message = failure if isinstance(failure, str) else f"{type(failure).__name__}: {failure}"
                kind = failure if isinstance(failure, str) else getattr(failure, "type", type(failure).__name__)
                span.set_attribute("error.type", kind)
                span.set_status(Status(StatusCode.ERROR, message))
            span.end(end_time=self.epoch_ns(end if end is not None else max(now, start)))


def _failure(future, seen: BaseException | None) -> BaseException | str | None:
    """Why a job did not succeed: its own error, or (given up, unfinished) what ended the wait; None if it did."""
    if future.done() and not future.cancelled():
        return future.exception()
    return seen if seen is not None else "cancelled"


def _generated_tokens(job, failure) -> int | None:
    """Its longest hypothesis' tokens; for a job that did not finish, what a single-row search got to."""
    if failure is None:
        return max((len(h.tokens) for h in job.future.result()), default=0)
    return job.phases.generated
