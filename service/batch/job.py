"""Running a batch job's lines through the in-process app (`service.batch.asgi`): at most `max_in_flight` requests
at once, enough to keep the schedulers' continuous and dynamic batches full and few enough that none is refused as
overload, in an order bucketed by length (within each `ORDER_CHUNK` lines, longest first, as CTranslate2's
`translate_file` sorts each batch it reads: neighbours in a prompt pass pad little, and the longest do not come
last). Each `Outcome` is handed to the caller as it completes, on the caller's task: a result is written whole
before the next is taken, and cancelling the caller (Ctrl-C) cancels the requests still in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from service.batch.asgi import Answer, post
from service.batch.formats import TRANSLATE, Line, LineProblem, request_body
from service.http.middleware import INTERNAL_TYPE

log = logging.getLogger(__name__)

# lines sorted together: far more than are in flight, and the most a plain-text result waits to be written in order
ORDER_CHUNK = 1024
# the text models' two decoding workers' 64 rows each (the defaults) kept full, and 64 more waiting to take a finished
# row's place at the next step; under TSERVE_MAX_QUEUE_SIZE (256), so no line is refused as overload
DEFAULT_MAX_IN_FLIGHT = 192
OVERLOADED = 429
MAX_OVERLOAD_RETRIES = 8  # a 429 (the scoring route's few slots) is sent again after its retry-after-ms, this often
RETRY_AFTER_MS_HEADER = "retry-after-ms"
DEFAULT_RETRY_AFTER_S = 1.0
MS_PER_SECOND = 1000


@dataclass(frozen=True)
class Outcome:
    """A line's result: the app's answer, or the problem that kept it from being sent; the tokens it generated."""

    line: Line
    answer: Answer | None = None
    problem: LineProblem | None = None
    tokens: int = 0

    @property
    def failed(self) -> bool:
        return self.answer is None or self.answer.status >= 400


def bucketed(lines: Sequence[Line], chunk: int = ORDER_CHUNK) -> list[Line]:
    """The lines in the order they are sent: each run of `chunk` lines longest first (a stable sort: equal lengths
    keep their order)."""
    ordered = []
    for start in range(0, len(lines), chunk):
        ordered += sorted(lines[start:start + chunk], key=lambda line: -line.size)
    return ordered


async def completed(app: FastAPI, lines: Sequence[Line], base: Path,
                    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> AsyncIterator[Outcome]:
    """The lines' outcomes as they complete, `lines` sent in their order with at most `max_in_flight` at once.
    Use it under `contextlib.aclosing`: closing it cancels what is still in flight."""
    queued = iter(lines)
    running: set[asyncio.Task] = set()
    try:
        while True:
            while len(running) < max_in_flight and (line := next(queued, None)) is not None:
                running.add(asyncio.create_task(send(app, line, base)))
            if not running:
                return
            finished, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                yield task.result()
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


async def send(app: FastAPI, line: Line, base: Path) -> Outcome:
    """One line through the app (a 429 sent again after the wait it asks for); its problem if it cannot be sent."""
    if line.problem is not None:
        return Outcome(line, problem=line.problem)
    try:
        body = request_body(line, base)
    except LineProblem as problem:
        return Outcome(line, problem=problem)
    try:
        answer = await post(app, line.url, body)
        for _ in range(MAX_OVERLOAD_RETRIES):
            if answer.status != OVERLOADED:
                break
            await asyncio.sleep(_retry_after_s(answer))
            answer = await post(app, line.url, body)
    except Exception as error:  # the app failed past its own error handling: this line's error, not the job's end
        log.exception("line %d failed in the app", line.number)
        return Outcome(line, problem=LineProblem(INTERNAL_TYPE, f"line {line.number}: the app failed: {error!r}"))
    return Outcome(line, answer, tokens=generated_tokens(app, line, answer))


def _retry_after_s(answer: Answer) -> float:
    try:
        return int(answer.headers[RETRY_AFTER_MS_HEADER]) / MS_PER_SECOND
    except (KeyError, ValueError):
        return DEFAULT_RETRY_AFTER_S


def generated_tokens(app: FastAPI, line: Line, answer: Answer) -> int:
    """The tokens an answer generated, for the progress bar: its usage's `completion_tokens` where it has one, a
    translation's texts counted by its model's tokenizer; 0 for anything else."""
    if answer.status >= 400:
        return 0
    try:
        data = answer.json()
        usage = data.get("usage") or {}
        if isinstance(usage.get("completion_tokens"), int):
            return usage["completion_tokens"]
        loaded = app.state.registry.loaded.get((data.get("model"), data.get("version")))
        if line.url != TRANSLATE or loaded is None:
            return 0
        texts = [t["text"] for n_best in data["translations"] for t in n_best]
        return sum(len(encoding.ids) for encoding in loaded.engine.tokenizer.encode_batch(texts))
    except (ValueError, KeyError, TypeError, AttributeError):
        return 0
