"""A batch job over a requests file (OpenAI's Batch JSONL, `service.batch.formats`): every input line answered by
one output line, in the order the answers complete (match them by `custom_id`), errors as error lines; the lines an
earlier run already answered in the output file are skipped; a `custom_id` seen before in the file is an error
line of its own (OpenAI's rule: they are unique). Blank lines are no requests and get no output line.
"""

from __future__ import annotations

import dataclasses
import json
from contextlib import aclosing
from pathlib import Path
from typing import TextIO

from fastapi import FastAPI

from service.batch.formats import DUPLICATE_ID, Line, LineProblem, output_line, parse_line, split_lines
from service.batch.job import bucketed, completed
from service.batch.outputs import write_line
from service.batch.progress import Progress


def plan(data: bytes, done: set[str]) -> tuple[list[Line], int]:
    """The lines still to answer, and how many the output already answers."""
    lines, skipped, first_seen = [], 0, {}
    for number, raw in enumerate(split_lines(data), 1):
        if not raw.strip():
            continue
        line = parse_line(number, raw)
        if line.key in done:
            skipped += 1
            continue
        if line.custom_id is not None:
            if line.custom_id in first_seen and line.problem is None:
                line = dataclasses.replace(line, problem=LineProblem(
                    DUPLICATE_ID, f"line {number}: custom_id {line.custom_id!r} is also line "
                                  f"{first_seen[line.custom_id]}'s; each must be unique"))
            first_seen.setdefault(line.custom_id, number)
        lines.append(line)
    return lines, skipped


async def run_requests(app: FastAPI, data: bytes, done: set[str], out: TextIO, base: Path, max_in_flight: int,
                       show_progress: bool | None) -> None:
    """Answer the requests file's lines that `done` does not hold into `out`."""
    lines, skipped = plan(data, done)
    progress = Progress(len(lines), skipped, show_progress)
    try:
        async with aclosing(completed(app, bucketed(lines), base, max_in_flight)) as outcomes:
            async for outcome in outcomes:
                write_line(out, json.dumps(output_line(outcome.line, outcome.answer, outcome.problem)))
                progress.done(outcome.tokens, outcome.failed)
    finally:
        progress.close()
