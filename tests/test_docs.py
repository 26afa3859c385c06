"""The README and docs/ stay a readable, linked set: every relative link of README.md and docs/*.md reaches a file
of the checkout and, where it names an anchor, a heading (or `<a id>`) of that file; the README stays the short
page a new user reads first; each moved section has one home."""

from __future__ import annotations

import json

import pytest

from tests.support import ROOT
from tests.support.examples import all_examples, label
from tests.support.markdown import anchors, relative_links, sections

README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
# The README is the page a newcomer reads in ten minutes: what this is, how to run it, one example per API, the
# docs map; reference and measurements live in docs/.
README_MAX_LINES = 400


@pytest.mark.parametrize("document", DOCUMENTS, ids=[str(d.relative_to(ROOT)) for d in DOCUMENTS])
def test_every_relative_link_reaches_its_file_and_anchor(document):
    broken = []
    for number, target in relative_links(document):
        file_part, _, anchor = target.partition("#")
        linked = (document.parent / file_part).resolve() if file_part else document
        if not linked.exists():
            broken.append(f"{number}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{number}: {target} (no heading or <a id> #{anchor} in {linked.relative_to(ROOT)})")
    assert not broken, f"{document.relative_to(ROOT)}: dead links:\n" + "\n".join(broken)


def test_the_readme_is_short_and_maps_the_docs():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    linked = {target.partition("#")[0] for _, target in relative_links(README)}
    unlinked = [d.name for d in DOCUMENTS[1:] if f"docs/{d.name}" not in linked]
    assert not unlinked, f"docs README.md does not link to: {unlinked}"


def test_no_heading_appears_in_two_documents():
    """A section moved out of the README lives in one place: the same heading in two documents is a copy."""
    homes: dict[str, str] = {}
    repeated = []
    for document in DOCUMENTS:
        for anchor in sections(document):
            if anchor in homes and not anchor.startswith(("measurements", "why", "what")):
                repeated.append(f"#{anchor}: {homes[anchor]} and {document.name}")
            homes.setdefault(anchor, document.name)
    assert not repeated, "\n".join(repeated)


def test_every_shell_example_shows_its_output():
    """What `make readme-check` compares: each `$ curl` example of the README and docs/api.md prints an output,
    and a JSON one parses (so an edit that breaks an example's output shows here before the check runs)."""
    found = all_examples()
    assert len(found) >= 20, [label(e) for e in found]
    for example in found:
        assert example.output, f"{label(example)}: no output under {example.command[:80]}"
        assert "localhost:8000" in example.command, label(example)
        for line in example.output.splitlines():
            line = line.removeprefix("data: ")
            while line.startswith(("{", "[")) and line != "[DONE]":  # `{...}{...}`: two commands' outputs on one line
                _, end = json.JSONDecoder().raw_decode(line)
                line = line[end:]
