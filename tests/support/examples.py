"""The shell examples of the README and docs/api.md: each `$ curl ...` line of a console block (with its `\\`
continuation lines) and the output printed under it, up to the next command or the block's end. `make readme-check`
runs them against a server on the release models; the test suite checks that each one shows its output."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.support import ROOT

DOCUMENTS = (ROOT / "README.md", ROOT / "docs" / "api.md")
PROMPT = "$ "
FENCE = "```"


@dataclass(frozen=True)
class Example:
    document: Path
    line: int  # of the command's first line
    command: str  # continuation lines joined, as bash reads them
    output: str  # as printed, lines joined with newlines, trailing blank lines dropped


def examples(document: Path) -> list[Example]:
    found: list[Example] = []
    command: list[str] = []
    output: list[str] = []
    start, in_console = 0, False

    def close() -> None:
        if command:
            found.append(Example(document, start, " ".join(part.rstrip("\\").strip() for part in command),
                                 "\n".join(output).rstrip("\n")))
        command.clear()
        output.clear()

    for number, raw in enumerate(document.read_text().splitlines(), start=1):
        line = raw.strip() if raw.startswith("  ") else raw  # blocks indented under a list item
        if line.startswith(FENCE):
            close()
            in_console = line == FENCE + "console" and not in_console
            continue
        if not in_console:
            continue
        if line.startswith(PROMPT):
            close()
            start, command[:] = number, [line[len(PROMPT):]]
        elif command and command[-1].endswith("\\") and not output:
            command.append(line)
        elif command:
            output.append(line)
    return found


def all_examples() -> list[Example]:
    return [example for document in DOCUMENTS for example in examples(document)]


def label(example: Example) -> str:
    return f"{example.document.relative_to(ROOT)}:{example.line}"


def first_url_path(command: str) -> str:
    match = re.search(r"localhost:8000(/\S*)", command)
    return match.group(1).rstrip("'\"") if match else ""
