"""Awaiting a request's scheduler work from a route: the result, or an error at the request's deadline or when
its client goes away, and the scheduler told to drop the work in both cases.

Starlette does not cancel a handler when its client disconnects (only streaming responses listen), so the wait
polls for a disconnect; the deadline is awaited to the moment, not at the next poll.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from fastapi import Request

from service.errors import Cancelled, DeadlineExceeded

DISCONNECT_POLL_S = 0.2  # how often a waiting route checks whether its client is still there


async def await_results(request: Request, futures: Sequence[Future], deadline: float,
                        abandon: Callable[[], None]) -> list:
    """The futures' results, in order. Raises DeadlineExceeded at `deadline` (time.monotonic() seconds),
    Cancelled when the client disconnects, or the first future's error; in each case `abandon()` runs first."""
    gathered = asyncio.gather(*(asyncio.wrap_future(future) for future in futures))
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded("the request's deadline expired")
            done, _ = await asyncio.wait({gathered}, timeout=min(DISCONNECT_POLL_S, remaining))
            if done:
                return gathered.result()
            if await request.is_disconnected():
                raise Cancelled("client went away")
    except BaseException:
        abandon()
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no asyncio error log
        gathered.cancel()
        raise
