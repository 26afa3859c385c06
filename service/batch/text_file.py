"""Plain-text translation (CTranslate2's `translate_file`): one German sentence per input line, its English
translation (the best of its n-best list) on the same line of the output, in input order. Each sentence is one
`/v1/translate` request with the job's options (`num_beams`, `length_penalty`, ..., as the API names them). A blank
line is translated as a blank line, unsent; a line the API refuses (too long for the model, not UTF-8) is an empty
line, named on standard error. A rerun appends after the lines the output already holds.
"""

from __future__ import annotations

from contextlib import aclosing
from pathlib import Path
from typing import TextIO

from fastapi import FastAPI
from pydantic import BaseModel, ValidationError

from service.batch.formats import TRANSLATE, Line, LineProblem, output_line, split_lines
from service.batch.job import Outcome, bucketed, completed
from service.batch.outputs import write_line
from service.batch.progress import Progress
from service.errors import describe_validation

NOT_TEXT = "invalid_text"
FIXED_OPTIONS = {"text": "the input's lines", "stream": "a file", "num_return_sequences": "one line per sentence"}
VALIDATION_TEXT = "Satz."  # any sentence: the options are checked against the request model with it


class OptionsProblem(ValueError):
    """Options the translate request model refuses, or ones this mode sets itself; the message names them."""


def check_options(options: dict, translate_model: type[BaseModel]) -> None:
    """OptionsProblem unless `options` make a valid `/v1/translate` request of one text (the API's own model)."""
    fixed = [f"{name} (fixed: {why})" for name, why in FIXED_OPTIONS.items() if name in options]
    if fixed:
        raise OptionsProblem(f"plain-text mode sets {', '.join(fixed)}; use a requests file for the rest")
    try:
        translate_model.model_validate({**options, "text": VALIDATION_TEXT})
    except ValidationError as error:
        raise OptionsProblem(f"-O: {describe_validation(error.errors())}") from None


def plan(data: bytes, skip: int, options: dict) -> tuple[list[Line], dict[int, str]]:
    """The sentences to translate (after the first `skip` lines) as translate lines, and the blank lines' output."""
    lines, blank = [], {}
    for number, raw in enumerate(split_lines(data)[skip:], skip + 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            lines.append(Line(number, problem=LineProblem(NOT_TEXT, f"line {number} is not UTF-8")))
            continue
        if text.strip():
            lines.append(Line(number, url=TRANSLATE, body={**options, "text": text}, size=len(raw)))
        else:
            blank[number] = ""
    return lines, blank


def translation(outcome: Outcome, progress: Progress) -> str:
    """An outcome's output line: its best translation on one line, or empty (the reason on standard error)."""
    if not outcome.failed:
        return " ".join(outcome.answer.json()["translations"][0][0]["text"].splitlines())
    error = output_line(outcome.line, outcome.answer, outcome.problem)["error"]
    progress.note(f"line {outcome.line.number}: not translated ({error['code']}): {error['message']}")
    return ""


async def run_text(app: FastAPI, data: bytes, skip: int, options: dict, out: TextIO, max_in_flight: int,
                   show_progress: bool | None) -> int:
    """Translate the lines after the first `skip` into `out`, in input order; the number of lines that failed."""
    lines, ready = plan(data, skip, options)
    following = skip + 1  # the number of the next line to write

    def write_ready() -> None:
        nonlocal following
        while following in ready:
            write_line(out, ready.pop(following))
            following += 1

    progress = Progress(len(lines), skip, show_progress)
    try:
        write_ready()  # blank lines first in the file
        async with aclosing(completed(app, bucketed(lines), Path.cwd(), max_in_flight)) as outcomes:
            async for outcome in outcomes:
                ready[outcome.line.number] = translation(outcome, progress)
                progress.done(outcome.tokens, outcome.failed)
                write_ready()
    finally:
        progress.close()
    return progress.errors
