"""A batch job's output: standard output, or a file that a rerun appends to (what makes a job resumable), each line
written whole and flushed before the next. A file a job was stopped in the middle of writing (killed between a
line's bytes) ends in a partial line: `resumed_lines` cuts it off, so that the file holds complete lines only and the
line is done again.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import TextIO

from service.batch.formats import done_key, split_lines

log = logging.getLogger(__name__)

STDIO = "-"  # -i - / -o -: standard input and output, as vLLM's run-batch and most command lines
NEWLINE = b"\n"


class OutputProblem(Exception):
    """An output file this job cannot append to: the message says why."""


def resumed_lines(path: str, overwrite: bool) -> list[bytes]:
    """The complete lines an output file already holds, a partial last line cut off the file first; none for
    standard output, a file not there yet, or with `overwrite`."""
    file = Path(path)
    if path == STDIO or overwrite or not file.exists():
        return []
    data = file.read_bytes()
    if data and not data.endswith(NEWLINE):
        kept = data.rfind(NEWLINE) + 1
        log.warning("%s ends in a partial line (%d bytes): cut off, its line is done again", path, len(data) - kept)
        with file.open("r+b") as raw:
            raw.truncate(kept)
        data = data[:kept]
    return split_lines(data)


def open_output(path: str, overwrite: bool) -> TextIO:
    """The stream the job writes to: standard output, or the file, appended to unless `overwrite`."""
    if path == STDIO:
        return sys.stdout
    return Path(path).open("w" if overwrite else "a", encoding="utf-8", newline="\n")


def done_keys(path: str, lines: list[bytes]) -> set[str]:
    """The keys of the input lines an earlier run of the job answered in `lines`, the output file's lines."""
    keys = set()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            record = None
        key = done_key(record) if isinstance(record, dict) else None
        if key is None:
            raise OutputProblem(f"{path}, line {number}, is not a batch output line: not this job's output file "
                                "(give another -o, or --overwrite to start it afresh)")
        keys.add(key)
    return keys


def write_line(out: TextIO, text: str) -> None:
    """One line, whole, on its way to the file before the next (a stopped job leaves complete lines)."""
    out.write(text + "\n")
    out.flush()
