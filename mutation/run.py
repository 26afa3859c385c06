"""`make mutation`: mutation testing (mutmut 3) of the core the unit tests must pin down, package by package.

Each package of mutation/packages.toml runs in its own folder, mutation/work/<package>/: links to the checkout's
service/, export/, models/, tests/ and pyproject.toml, and a setup.cfg written from the package's entry (the files to
mutate, the tests to run, always with -m "not slow": no server, no trained model). mutmut copies the sources into
mutants/ there, makes the mutants, and runs for each one only the tests that call the mutated function. Every verdict
is kept in mutants/: a rerun tests the mutants of functions whose source changed and, since mutmut keeps a verdict
until then, this driver re-tests the last run's survivors too (a test added since may kill them).

mutmut over cosmic-ray: mutmut 3 forks a warm pytest process per mutant and runs only the tests that reach the mutated
function (each mutant is switched on in its function's trampoline; the code is imported once), where cosmic-ray runs
the whole test command afresh for each mutant. mutmut 3 does not mutate decorated functions (export.checks'
`@torch.no_grad()` checks) nor code outside functions (constants, class bodies).

A mutant is killed when a test fails (or the tests time out: a mutant that hangs is caught too); it survives when
the tests pass; a mutant of a function no selected test calls counts as a survivor ("no tests"). Mutants listed in
mutation/equivalent.toml (equivalent to the original: no test can tell them apart) are left out of the total and
counted apart. A package's `functions` restrict its score to those functions' mutants (nested ones included). Prints
per package, and overall:

    mutation score: <package> <killed>/<total> = <x>%

and writes each package's survivors, with their diffs, to mutation/work/<package>/survivors.txt.

    python mutation/run.py [PACKAGE ...] [--max-children N] [--scores-only]
"""

from __future__ import annotations

import argparse
import ast
import difflib
import fnmatch
import json
import os
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "mutation"
WORK = HERE / "work"
LINKED = ("service", "export", "models", "tests", "pyproject.toml", "model_repository")
KILLED = {1, 3, 24, -24, 152, 255, 36, -11, -9}  # a failing test, a pytest error, a timeout, a crash
SURVIVED = {0}
NO_TESTS = {5, 33}
# How long a test waits for a result, a step or a stop under mutation (tests/support/waiting.py PATIENCE_S, 30 s
# otherwise): the right code answers in milliseconds, a mutant that hangs a scheduler fails in seconds, not in 30.
PATIENCE_S = "3"
# A mutant that spins is killed after this many times its tests' time (in CPU seconds; mutmut's default 15x costs
# minutes per spinning mutant): the tests mostly wait, so their CPU time is well below the wall time measured.
TIMEOUT_MULTIPLIER = 3.0


def load_packages() -> dict[str, dict]:
    return tomllib.loads((HERE / "packages.toml").read_text())


def load_equivalent() -> dict[str, str]:
    """mutant name -> why it is equivalent."""
    path = HERE / "equivalent.toml"
    if not path.exists():
        return {}
    return {name: entry["why"] for name, entry in tomllib.loads(path.read_text()).get("mutant", {}).items()}


def setup_cfg(package: dict) -> str:
    def block(key: str, values: list[str]) -> str:
        return f"{key}=\n" + "".join(f"    {v}\n" for v in values) if values else ""

    return (
        "[mutmut]\n"
        + block("source_paths", ["service", "export"])
        + block("only_mutate", package["mutate"])
        + block("do_not_mutate", package.get("skip", []))
        # the released GPT's tokenizer and graphs: the constraint tests compile over its tokenizer and decode with it;
        # a package's own `also_copy` adds what its tests read (e.g. the released ViT)
        + block("also_copy", ["models/", "model_repository/gpt/", *package.get("also_copy", [])])
        + block("pytest_add_cli_args", ["-p", "no:cacheprovider", "-q", "-m", "not slow"])
        + block("pytest_add_cli_args_test_selection", package["tests"])
        + f"timeout_multiplier={TIMEOUT_MULTIPLIER}\n"
    )


def prepare(name: str, package: dict) -> Path:
    work = WORK / name
    work.mkdir(parents=True, exist_ok=True)
    for entry in LINKED:
        link = work / entry
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(ROOT / entry, work))
    config = setup_cfg(package)
    cfg = work / "setup.cfg"
    if not cfg.exists() or cfg.read_text() != config:
        cfg.write_text(config)
    return work


def mutmut() -> str:
    return str(Path(sys.executable).parent / "mutmut")


GENERATE = """\
import os
from mutmut.__main__ import copy_also_copy_files, copy_src_dir, create_mutants, setup_source_paths
from mutmut.mutation.trampoline import set_mutant_under_test
set_mutant_under_test("mutant_generation")
os.makedirs("mutants", exist_ok=True)
copy_src_dir(); copy_also_copy_files(); setup_source_paths(); create_mutants({max_children})
"""


def generate(work: Path, max_children: int) -> int:
    """The first steps of `mutmut run` alone (mutmut 3.8 has no command for them): copy the sources into mutants/
    and write the mutants of every function whose source changed since the last run, their verdicts reset."""
    return subprocess.call([sys.executable, "-c", GENERATE.format(max_children=max_children)], cwd=work,
                           stdout=subprocess.DEVNULL)


def exact(key: str) -> str:
    """A mutmut name filter that matches `key` alone: a name with a `*` is matched with fnmatch (the leading `*`
    matches nothing, keys start with the module), and mutmut looks a plain name's tests up without a default, which
    fails for a function no test calls."""
    return "*" + key


def run_package(work: Path, package: dict, max_children: int, equivalent: dict[str, str]) -> int:
    """Generate the mutants, then run by name only those the package's score needs a verdict for: the scored
    mutants not tested yet (new, or of a function that changed) and the last run's survivors (a test added since may
    kill them). mutmut's plain `run` would also test every unscored mutant (the response models and schema
    documentation beside a package's `functions`), and it keeps a survivor's verdict until its function changes."""
    started = time.monotonic()
    rc = generate(work, max_children)
    if rc != 0:
        print(f"    mutant generation in {work.relative_to(ROOT)} failed: exit {rc}", flush=True)
        return rc
    pending = [k for k, code in results(work, package).items()
               if code is None or (code not in KILLED and k not in equivalent)]
    if not pending:
        print("    nothing to test: every scored mutant has its verdict", flush=True)
        return 0
    print(f"    testing {len(pending)} mutants (new, changed or surviving)", flush=True)
    # One thread per test process: mutmut runs max_children of them at once on as many cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "TSERVE_TEST_PATIENCE_S": PATIENCE_S}
    command = [mutmut(), "run", "--max-children", str(max_children), *map(exact, pending)]
    rc = subprocess.call(command, cwd=work, env=env)
    print(f"    mutmut in {work.relative_to(ROOT)}: exit {rc}, {time.monotonic() - started:.0f} s", flush=True)
    return rc


class Mutated:
    """A mutated source file of mutants/: where each mutant's function is (its .spans), to tell which function, or
    function nested in it, a mutant changes."""

    def __init__(self, path: Path):
        self.lines = path.read_text().splitlines()
        self.spans = json.loads(Path(str(path) + ".spans").read_text())["spans"]

    def _function(self, mangled: str) -> tuple[list[str], list[str]]:
        base = mangled.rsplit("__mutmut_", 1)[0]
        (o0, o1), (m0, m1) = self.spans[base + "__mutmut_orig"], self.spans[mangled]
        return self.lines[o0 - 1 : o1], self.lines[m0 - 1 : m1]

    def diff(self, mangled: str) -> str:
        """The mutant's change, as a unified diff of its function (`mutmut show`, without starting mutmut)."""
        original, mutant = self._function(mangled)
        orig = mangled.rsplit("__mutmut_", 1)[0] + "__mutmut_orig"
        mutant = [line.replace(mangled, orig) for line in mutant]
        return "\n".join(list(difflib.unified_diff(original, mutant, lineterm="", n=1))[2:])

    def changed_function(self, mangled: str) -> str:
        """The name of the innermost function (a nested one included) around the mutant's first changed line."""
        base = mangled.rsplit("__mutmut_", 1)[0]
        name = base.rsplit("ǁ", 1)[-1] if "ǁ" in base else base[len("x_"):]
        original, mutant = self._function(mangled)
        orig = base + "__mutmut_orig"
        mutant = [line.replace(mangled, orig) for line in mutant]
        changed = next((i for i, (a, b) in enumerate(zip(original, mutant)) if a != b), None)
        if changed is None:
            return name
        tree = ast.parse(textwrap.dedent("\n".join(original)))
        innermost = name
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node is not tree.body[0]:
                if node.lineno - 1 <= changed <= node.end_lineno - 1:
                    innermost = node.name  # ast.walk is breadth first: deeper defs come later
        return innermost


def results(work: Path, package: dict) -> dict[str, int | None]:
    """mutant name -> mutmut's exit code (None: not checked) for the mutants that count in the package's score."""
    out: dict[str, int | None] = {}
    functions = package.get("functions")
    for meta in sorted((work / "mutants").rglob("*.py.meta")):
        source = meta.relative_to(work / "mutants").as_posix()[: -len(".meta")]
        if not any(fnmatch.fnmatch(source, g) for g in package["mutate"]):
            continue
        if any(fnmatch.fnmatch(source, g) for g in package.get("skip", [])):
            continue
        mutated = Mutated(work / "mutants" / source) if functions else None
        for key, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            if mutated is None or mutated.changed_function(key.rsplit(".", 1)[-1]) in functions:
                out[key] = code
    return out


def score(name: str, work: Path, package: dict, equivalent: dict[str, str]) -> tuple[int, int]:
    codes = results(work, package)
    modules = {k.rsplit(".", 1)[0] for k in codes}
    for key in sorted(k for k in equivalent if k.rsplit(".", 1)[0] in modules and k not in codes):
        print(f"    mutation/equivalent.toml: {key} is gone (its function changed): delete the entry", flush=True)
    for key in sorted(k for k in equivalent if codes.get(k) in KILLED):
        print(f"    mutation/equivalent.toml: {key} was killed, so it is not equivalent: delete the entry", flush=True)
    equal = sorted(k for k in codes if k in equivalent and codes[k] not in KILLED)
    killed = sum(1 for c in codes.values() if c in KILLED)
    total = len(codes) - len(equal)
    survivors = sorted(k for k, c in codes.items() if c not in KILLED and k not in equivalent)
    lines, mutated = [], {}
    for key in survivors:
        status = "survived" if codes[key] in SURVIVED else "no tests" if codes[key] in NO_TESTS else f"exit {codes[key]}"
        module, mangled = key.rsplit(".", 1)
        if module not in mutated:
            mutated[module] = Mutated(work / "mutants" / (module.replace(".", "/") + ".py"))
        lines.append(f"## {key} ({status})\n{mutated[module].diff(mangled)}\n")
    (work / "survivors.txt").write_text("".join(lines))
    pct = 100.0 * killed / total if total else 100.0
    print(f"mutation score: {name} {killed}/{total} = {pct:.1f}%"
          + (f" ({len(equal)} equivalent mutants left out: mutation/equivalent.toml)" if equal else ""), flush=True)
    if survivors:
        print(f"    {len(survivors)} survivors: {(work / 'survivors.txt').relative_to(ROOT)}", flush=True)
    return killed, total


def main() -> int:
    packages = load_packages()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("packages", nargs="*", choices=[[], *packages], default=[], metavar="PACKAGE",
                        help=f"of {', '.join(packages)} (default: all, in this order)")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--scores-only", action="store_true", help="print the scores of the last runs, run nothing")
    args = parser.parse_args()
    names = args.packages or list(packages)
    equivalent = load_equivalent()
    all_killed = all_total = 0
    failed = []
    for name in names:
        work = prepare(name, packages[name])
        if not args.scores_only:
            print(f"== {name}", flush=True)
            if run_package(work, packages[name], args.max_children, equivalent) != 0:
                failed.append(name)
        killed, total = score(name, work, packages[name], equivalent)
        all_killed, all_total = all_killed + killed, all_total + total
    if len(names) > 1:
        pct = 100.0 * all_killed / all_total if all_total else 100.0
        print(f"mutation score: overall {all_killed}/{all_total} = {pct:.1f}%")
    if failed:
        print(f"mutmut failed for: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
