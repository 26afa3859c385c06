"""Awaiting a request's work from a route (image decoding, the scheduler's futures): the result, or an error at
the request's deadline or when its client goes away, and the work dropped in both cases. `run_text_jobs` is the
one way a serving module runs text jobs to their results: submit, await, trace.

Starlette does not cancel a handler when its client disconnects (only streaming responses listen), so the wait
polls for a disconnect; the deadline is awaited to the moment, not at the next poll.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future


from service.decoding import Hypothesis
from service.errors import Cancelled, DeadlineExceeded
from service.observability import tracing
from service.scheduling.jobs import TextJob
from service.serving.streaming import submit
from service.serving.context import Caller

DISCONNECT_POLL_S = 0.2  # how often a waiting route checks whether its client is still there


async def watched(request: Caller, work: Awaitable, deadline: float, abandon: Callable[[], None] | None = None):
    """The result of `work`. Raises DeadlineExceeded at `deadline` (time.monotonic() seconds), Cancelled when the
    client disconnects, or the work's own error; on any of these `work` is cancelled and `abandon()` runs first."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded("the request's deadline expired")
            done, _ = await asyncio.wait({task}, timeout=min(DISCONNECT_POLL_S, remaining))
            if done:
                return task.result()
            if await request.is_disconnected():
                raise Cancelled("client went away")
    except BaseException:
        if abandon is not None:
            abandon()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no asyncio error log
        task.cancel()
        raise


async def await_results(request: Caller, futures: Sequence[Future], deadline: float,
                        abandon: Callable[[], None]) -> list:
    """The scheduler futures' results, in order, watched as `watched` says (`abandon` tells the scheduler)."""
    return await watched(request, asyncio.gather(*(asyncio.wrap_future(future) for future in futures)), deadline,
                         abandon)


async def run_text_jobs(request: Caller, loaded, jobs: Sequence[TextJob],
                        deadline: float) -> list[list[Hypothesis]]:
    """Submit every job (or none: `streaming.submit`), then each job's hypotheses, best first, in order, awaited as
    `watched` says (the jobs cancelled when the request ends early); their phase spans once over (tracing on)."""
    submit(loaded, jobs)
    with tracing.text_spans(loaded, jobs):
        return await await_results(request, [job.future for job in jobs], deadline,
                                   abandon=lambda: [job.cancel() for job in jobs])
