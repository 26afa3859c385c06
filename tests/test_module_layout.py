"""The serving package stays readable: each module one concern of at most MAX_MODULE_LINES lines, opening with a
docstring of at most MAX_DOCSTRING_LINES lines (what it holds, what it follows, the invariant that matters); the
details and measurements live in docs/architecture.md's design notes and docs/benchmarks.md. The generated gRPC
stubs are not ours to shape."""

from __future__ import annotations

import ast

import pytest

from tests.support import ROOT

MAX_MODULE_LINES = 350
MAX_DOCSTRING_LINES = 15
MODULES = sorted(path for path in (ROOT / "service").rglob("*.py") if "generated" not in path.parts)


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_a_module_is_short_and_says_what_it_holds(path):
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_MODULE_LINES, f"{len(source.splitlines())} lines: split it by concern"
    docstring = ast.get_docstring(ast.parse(source), clean=False)
    if path.name != "__init__.py" or source.strip():
        assert docstring, "no module docstring"
    if docstring:
        lines = len(docstring.splitlines())
        assert lines <= MAX_DOCSTRING_LINES, f"a {lines}-line docstring: details go to docs/architecture.md"
