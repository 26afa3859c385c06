"""How a batch job hands lines to an app (service.batch.job, .asgi), against fake ASGI apps: never more than the window
in flight and every line back, the client kept until its answer has ended, a 429 sent again, and a line the app fails
on an error line of its own."""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing
from pathlib import Path

from service.batch.asgi import post
from service.batch.formats import Line
from service.batch.job import completed, send


async def answer(send_message, status: int, body: bytes, headers=()) -> None:
    await send_message({"type": "http.response.start", "status": status, "headers": list(headers)})
    await send_message({"type": "http.response.body", "body": body})


def lines(count: int) -> list[Line]:
    return [Line(n, f"id{n}", "/v1/generate", {"prompt": str(n)}) for n in range(1, count + 1)]


def test_at_most_the_window_is_in_flight_and_every_line_comes_back():
    inside, most = 0, 0

    async def app(scope, receive, send_message):
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        request = await receive()
        await asyncio.sleep(0.001 * (int(json.loads(request["body"])["prompt"]) % 3))  # out of order
        inside -= 1
        await answer(send_message, 200, request["body"])

    async def run():
        async with aclosing(completed(app, lines(20), Path("."), max_in_flight=3)) as outcomes:
            return [outcome async for outcome in outcomes]

    outcomes = asyncio.run(run())
    assert sorted(o.line.number for o in outcomes) == list(range(1, 21)) and most == 3
    assert all(json.loads(o.answer.body) == o.line.body and not o.failed for o in outcomes)


def test_the_client_stays_until_its_answer_has_ended():
    """A route that polls for a disconnect while it works (service.serving.awaiting) must see none."""
    seen = []

    async def app(scope, receive, send_message):
        await receive()
        try:
            seen.append(await asyncio.wait_for(receive(), 0.01))
        except TimeoutError:
            seen.append("still there")
        await answer(send_message, 200, b"{}")

    assert asyncio.run(post(app, "/v1/generate", b"{}")).status == 200
    assert seen == ["still there"]


def test_a_429_is_sent_again_after_the_wait_it_asks_for():
    calls = 0

    async def app(scope, receive, send_message):
        nonlocal calls
        calls += 1
        await receive()
        if calls < 3:
            await answer(send_message, 429, b'{"error": {"type": "overloaded", "message": "full"}}',
                         [(b"retry-after-ms", b"1")])
        else:
            await answer(send_message, 200, b"{}")

    outcome = asyncio.run(send(app, lines(1)[0], Path(".")))
    assert outcome.answer.status == 200 and calls == 3


def test_a_line_the_app_fails_on_is_an_error_line_of_its_own():
    async def app(scope, receive, send_message):
        raise RuntimeError("boom")

    outcome = asyncio.run(send(app, lines(1)[0], Path(".")))
    assert outcome.failed and outcome.answer is None
    assert outcome.problem.code == "internal_error" and "boom" in outcome.problem.message
