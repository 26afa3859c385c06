"""The project's Markdown as GitHub renders it: headings and their anchors, explicit `<a id>` anchors, and the
relative links of a document (code blocks and inline code skipped), for the tests that keep the docs linked."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

FENCE = "```"
HEADING = re.compile(r"(#{1,6}) (.*)")
EXPLICIT_ANCHOR = re.compile(r"<a (?:id|name)=\"([^\"]+)\"")
LINK = re.compile(r"\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading: inline code marks dropped, lower case, punctuation but - and _
    dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the text outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith(FENCE):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def sections(path: Path) -> dict[str, str]:
    """The headings of a document by anchor (a repeated heading's anchor numbered -1, -2, ... as GitHub does), each
    with its text up to the next heading."""
    found, anchor, seen = {}, None, Counter()
    for _, line in prose_lines(path.read_text()):
        heading = HEADING.fullmatch(line)
        if heading:
            base = github_anchor(heading.group(2))
            anchor = base if not seen[base] else f"{base}-{seen[base]}"
            seen[base] += 1
            found[anchor] = ""
        elif anchor is not None:
            found[anchor] += line + "\n"
    return found


def anchors(path: Path) -> set[str]:
    """Every anchor a link into the document may name: its headings' and its explicit `<a id="...">` ones."""
    explicit = {match for _, line in prose_lines(path.read_text()) for match in EXPLICIT_ANCHOR.findall(line)}
    return set(sections(path)) | explicit


def relative_links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link of the document that is not to another site or an e-mail address."""
    return [(number, target) for number, line in prose_lines(path.read_text())
            for target in LINK.findall(INLINE_CODE.sub("", line))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]
