"""The project's import graph: no cycles between modules, and the serving side never imports PyTorch.

Each module's imports are read from its source (`ast`, every `import`/`from` anywhere in the file, relative ones
resolved), so the test sees what a reader sees, including imports inside functions; a cycle is reported as the
chain of modules that closes it. Cycles through a package's `__init__.py` re-exports count too: importing a name
from a package runs its `__init__`, which imports its modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.support import ROOT
PACKAGES = ("service", "models", "export")
# What a serving install has: the serving side must import none of the training stack.
TRAINING_ONLY = ("torch", "models", "export", "transformers")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports: `from a.b import c` is a.b.c when that is a module, else a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(module: str) -> None:
        while module and module not in known:  # `import a.b.c` of a name that is not a module: its package
            module = module.rpartition(".")[0]
        if module and module != name:
            found.add(module)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                candidate = f"{module}.{alias.name}"
                add(candidate if candidate in known else module)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as the chain of modules around it, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            child = next(stack[-1], None)
            if child is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append(iter(sorted(graph[child])))
    return None


def test_the_cycle_finder_finds_a_cycle_and_passes_a_tree():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_relative_imports_are_resolved(tmp_path):
    graph = _graph()
    assert "service.decoding.greedy" in graph["service.decoding"]  # `from .greedy import ...` in its __init__


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package):
    graph = _graph()
    within = {name: {m for m in imports if m.split(".")[0] == package}
              for name, imports in graph.items() if name.split(".")[0] == package}
    cycle = _cycle(within)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_serving_side_never_imports_the_training_stack():
    offenders = []
    for name, path in _modules().items():
        if not name.startswith("service"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            offenders += [f"{name}: {m}" for m in modules if m.split(".")[0] in TRAINING_ONLY]
    assert not offenders, offenders


# The serving side's layers, bottom up: a module may import its own layer's and the layers below, never one above
# (docs/architecture.md, "How a request flows"; http/ is the transport the API packages' routes use). The base
# modules (settings, errors, the config schema and the repository reader, the observability package) sit below them
# all; the settings alone read upwards, to validate TSERVE_VARIANT with the variants' own parser, and are not checked.
LAYERS = ("service.decoding", "service.engines", "service.scheduling", "service.models", "service.serving",
          "service.http", "service.api")
BASE = ("service.settings", "service.errors", "service.config_schema", "service.repository",
        "service.observability")


def _layer(module: str) -> int | None:
    for index, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            return index
    return -1 if module.startswith(BASE) else None


def test_the_layers_import_downwards_only():
    upward = []
    for name, imports in _graph().items():
        own = _layer(name)
        if own is None or name == "service.settings":
            continue
        upward += [f"{name} -> {m}" for m in sorted(imports)
                   if (other := _layer(m)) is not None and other > own and not m.startswith(BASE)]
    assert not upward, "imports up the layers:\n" + "\n".join(upward)


def test_no_test_module_imports_another():
    """Shared test helpers live in tests/support/; a test module imported by another would run its tests twice
    and tie the two together."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}: {m}" for m in modules
                          if m.startswith("tests.") and m.rpartition(".")[2].startswith("test_")]
    assert not offenders, offenders
