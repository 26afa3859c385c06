"""Hand items from the scheduler threads to the event loop with one wake-up per burst, not one per item.

A decoding step of the continuous batcher produces a token for every streaming request at once. Waking the event
loop for each (`loop.call_soon_threadsafe` writes to its self-pipe every time) costs 32 wake-ups per step at 32
streams; a `LoopMailbox` buffers the step's deliveries and wakes the loop once, which then fills every stream's
queue in arrival order. Per-queue order is preserved: items for one queue are delivered in the order they were put.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any


class LoopMailbox:
    """`put(queue, item)` from any thread; the loop runs `queue.put_nowait(item)` for every item, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = weakref.ref(loop)  # weak: the registry below is keyed weakly by the loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Any]] = []

    def put(self, queue: asyncio.Queue, item: Any) -> None:
        with self._lock:
            self._pending.append((queue, item))
            wake = len(self._pending) == 1  # the first of a burst schedules the drain; the rest ride along
        loop = self._loop()
        if wake and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, item in pending:
            queue.put_nowait(item)


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = weakref.WeakKeyDictionary()


def mailbox_for(loop: asyncio.AbstractEventLoop) -> LoopMailbox:
    """The loop's mailbox (created on first use; call it from the loop's own thread)."""
    mailbox = _mailboxes.get(loop)
    if mailbox is None:
        mailbox = _mailboxes[loop] = LoopMailbox(loop)
    return mailbox
