"""LoopMailbox: thread -> event loop deliveries, one wake-up per burst, order kept per queue."""

from __future__ import annotations

import asyncio
import threading

from service.serving.handoff import LoopMailbox, mailbox_for


def test_a_burst_wakes_the_loop_once_and_keeps_each_queues_order():
    async def scenario():
        loop = asyncio.get_running_loop()
        wakeups = 0
        original = loop.call_soon_threadsafe

        def counting(callback, *args):
            nonlocal wakeups
            wakeups += 1
            return original(callback, *args)

        loop.call_soon_threadsafe = counting
        mailbox = LoopMailbox(loop)
        queues = [asyncio.Queue() for _ in range(3)]

        def producer():  # one decoding step: a token for each of 3 streams, 10 times over, then the ends
            for step in range(10):
                for i, queue in enumerate(queues):
                    mailbox.put(queue, (i, step))
            for queue in queues:
                mailbox.put(queue, None)

        thread = threading.Thread(target=producer)
        thread.start()
        thread.join()  # the loop is blocked meanwhile, so all 33 deliveries form one burst
        received = []
        for queue in queues:
            items = []
            while (item := await queue.get()) is not None:
                items.append(item)
            received.append(items)
        assert wakeups == 1
        assert received == [[(i, step) for step in range(10)] for i in range(3)]

        mailbox.put(queues[0], "later")  # a new burst after the drain wakes the loop again
        assert await queues[0].get() == "later" and wakeups == 2

    asyncio.run(scenario())


def test_one_mailbox_per_loop():
    async def get():
        return mailbox_for(asyncio.get_running_loop()), mailbox_for(asyncio.get_running_loop())

    first, again = asyncio.run(get())
    assert first is again
    other, _ = asyncio.run(get())
    assert other is not first
