"""The locked install (requirements/, `make lock`): the locks agree with what the project declares, and every install
path (`make venv`, `make bench-engine`, the three Dockerfiles) installs from them and from nothing else.

- Agreement: each lock holds every requirement of its inputs (pyproject.toml's dependencies and extras, locust.in,
  bench/requirements.txt, mutation/requirements.in) at a version the requirement's specifier allows, and nothing stale: every locked package
  is either a declared requirement or pulled in by another locked package (uv's `# via` annotations), each with the
  hashes `--require-hashes` verifies. The serving, locust and GPU locks run the dev lock's versions.
- PyTorch is out of the locks and pinned once (requirements/torch.txt, the CPU build of torch==2.13.0); its own
  dependencies are locked (resolved from that wheel's metadata).
- The installs: what `make -n` would run for a venv (pip, and uv with INSTALLER=uv) and every `pip install` of the
  Dockerfiles is a --no-deps install of torch's pin, of a lock with --require-hashes, or of the project itself.
- The running environment (the `make venv` the suite runs in) holds every locked package at its locked version.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.support import ROOT
from tests.support.locks import CPU_TARGET, GPU_TARGET, read_lock

REQUIREMENTS = ROOT / "requirements"
PROJECT = "transformer-serving (pyproject.toml)"


def requirement_lines(path: Path) -> list[Requirement]:
    """The requirements of a requirements-style input file (comments and options left out)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("-")]


def declared(extras: tuple[str, ...]) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    return [Requirement(r) for r in project["dependencies"]] + [Requirement(r) for e in extras for r in optional[e]]


def torch_pin() -> Requirement:
    (pin,) = requirement_lines(REQUIREMENTS / "torch.txt")
    return pin


# lock -> (its inputs: the requirements it must hold, the `via` names that mean "declared", packages left out, target)
def lock_inputs() -> dict[str, tuple[list[Requirement], set[str], set[str], dict]]:
    core = declared(())
    return {
        "dev.txt": (declared(("train", "dev", "load")), {PROJECT}, {"torch"}, CPU_TARGET),
        "serving.txt": (core, {PROJECT}, {"torch"}, CPU_TARGET),
        "serving-gpu.txt": (declared(("gpu",)) + requirement_lines(REQUIREMENTS / "gpu.in"),
                            {PROJECT, "-r requirements/gpu.in"}, {"torch", "onnxruntime"}, GPU_TARGET),
        "locust.txt": (requirement_lines(REQUIREMENTS / "locust.in"), {"-r requirements/locust.in"}, {"torch"},
                       CPU_TARGET),
        "bench.txt": (requirement_lines(ROOT / "bench" / "requirements.txt"), {"-r bench/requirements.txt"},
                      {"torch"}, CPU_TARGET),
        "kserve.txt": (requirement_lines(REQUIREMENTS / "kserve.in"), {"-r requirements/kserve.in"}, {"torch"},
                       CPU_TARGET),
        "ray.txt": (core + requirement_lines(REQUIREMENTS / "ray.in"), {PROJECT, "-r requirements/ray.in"}, {"torch"},
                    CPU_TARGET),
        "../mutation/requirements.txt": (requirement_lines(ROOT / "mutation" / "requirements.in"),
                                         {"-r mutation/requirements.in"}, {"torch"}, CPU_TARGET),
    }


LOCKS = sorted(lock_inputs())


def applies(requirement: Requirement, target: dict) -> bool:
    return requirement.marker is None or requirement.marker.evaluate({**default_environment(), **target, "extra": ""})


@pytest.mark.parametrize("lock", LOCKS)
def test_every_declared_requirement_is_locked_at_a_version_it_allows(lock):
    requirements, _, left_out, target = lock_inputs()[lock]
    locked = read_lock(REQUIREMENTS / lock)
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        if name in left_out or not applies(requirement, target):
            assert name not in locked, f"{lock}: {name} is left out of this lock, yet it is there"
            continue
        assert name in locked, f"{lock} lacks {requirement} (declared): run `make lock`"
        version = locked[name].version
        assert requirement.specifier.contains(version, prereleases=True), \
            f"{lock}: {name}=={version} is outside {requirement} (declared): run `make lock`"


@pytest.mark.parametrize("lock", LOCKS)
def test_nothing_in_a_lock_is_stale_and_everything_is_hashed(lock):
    """Every locked package is required by an input (and then declared there) or by another locked package (or by
    torch, whose own dependencies are locked); a constraint alone (`-c requirements/dev.txt`) pulls nothing in."""
    requirements, sources, left_out, _ = lock_inputs()[lock]
    names = {canonicalize_name(r.name) for r in requirements}
    locked = read_lock(REQUIREMENTS / lock)
    assert len(locked) > len(names) // 2, f"{lock}: parsed only {len(locked)} packages"
    for name, entry in locked.items():
        assert entry.hashes, f"{lock}: {name} has no hash (pip install --require-hashes would refuse the lock)"
        requirers = [via for via in entry.via if not via.startswith("-c ")]
        assert requirers, f"{lock}: {name} is required by nothing, only constrained: stale (run `make lock`)"
        for via in requirers:
            if via in sources:
                assert name in names, f"{lock}: {name} is locked as declared ({via}) but no longer is: stale"
            else:
                assert canonicalize_name(via) in locked or canonicalize_name(via) in left_out, \
                    f"{lock}: {name} is required by {via}, which is not locked: stale (run `make lock`)"


@pytest.mark.parametrize("lock", ["serving.txt", "serving-gpu.txt", "locust.txt", "ray.txt",
                                  "../mutation/requirements.txt"])
def test_the_images_run_the_versions_of_the_dev_lock(lock):
    """What the tests ran on (.venv, dev.txt) is what the images serve with, and what the mutation venv (layered
    over .venv) runs: every package they share has one version."""
    dev = read_lock(REQUIREMENTS / "dev.txt")
    for name, entry in read_lock(REQUIREMENTS / lock).items():
        if name in dev:
            assert entry.version == dev[name].version, \
                f"{lock}: {name}=={entry.version}, dev.txt: {dev[name].version} (run `make lock`)"


def test_torch_is_pinned_once_outside_the_locks_with_its_dependencies_locked():
    pin = torch_pin()
    assert pin.name == "torch" and str(pin.specifier) == "==2.13.0+cpu", "the documented CPU pin, torch==2.13.0"
    version = Version("2.13.0+cpu")
    (train_torch,) = [r for r in declared(("train",)) if r.name == "torch"]
    assert train_torch.specifier.contains(version)
    (bench_torch,) = [r for r in requirement_lines(ROOT / "bench" / "requirements.txt") if r.name == "torch"]
    assert bench_torch.specifier.contains(version)
    for lock in ("dev.txt", "bench.txt"):
        locked = read_lock(REQUIREMENTS / lock)
        assert "torch" not in locked and not any(name.startswith("nvidia-") for name in locked), \
            f"{lock}: torch (or PyPI's CUDA build's nvidia-* wheels) in the lock"
        by_torch = {name for name, entry in locked.items() if "torch" in entry.via}
        assert {"filelock", "sympy", "networkx", "jinja2", "fsspec", "typing-extensions"} <= by_torch, \
            f"{lock}: torch's own dependencies are not all locked"


def _make_dry_run(*args: str) -> list[str]:
    make = shutil.which("make")
    assert make, "`make` not found on PATH (sudo apt-get install make)"
    done = subprocess.run([make, "-n", "-C", str(ROOT), *args], capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def _assert_locked_installs(commands: list[str], lock: str) -> None:
    """Each install is --no-deps; together they are torch's pin, the lock with its hashes, the project."""
    installs = [c for c in commands if re.search(r"\bpip install\b", c)]
    assert installs, commands
    for command in installs:
        assert "--no-deps" in command.split(), f"an install that resolves dependencies: {command}"
    what = [next((w for w in ("-r requirements/torch.txt", f"--require-hashes -r {lock}", "-e .") if w in c), c)
            for c in installs]
    assert what == ["-r requirements/torch.txt", f"--require-hashes -r {lock}", "-e ."], installs
    assert any("-m pip check" in c for c in commands[commands.index(installs[-1]):]), "no `pip check` after the installs"


@pytest.mark.parametrize("installer", ["pip", "uv"])
def test_make_venv_installs_the_lock(tmp_path, installer):
    commands = _make_dry_run("venv", f"VENV={tmp_path / 'venv'}", f"INSTALLER={installer}")
    assert any(re.search(r"-m venv --clear \S*venv$", c) for c in commands), "the venv is not made afresh"
    _assert_locked_installs(commands, "requirements/dev.txt")
    assert all(("uv pip install" in c) == (installer == "uv") for c in commands if "pip install" in c)


def test_make_bench_engine_installs_the_bench_lock(tmp_path):
    commands = _make_dry_run("bench-engine", f"BENCH_VENV={tmp_path / 'bench'}")
    _assert_locked_installs(commands, "requirements/bench.txt")


def test_make_kserve_venv_installs_the_kserve_lock_alone(tmp_path):
    """The KServe SDK's venv (requirements/kserve.in): its lock with its hashes, no torch, no project."""
    commands = _make_dry_run("kserve-venv", f"KSERVE_VENV={tmp_path / 'kserve'}")
    installs = [c for c in commands if re.search(r"\bpip install\b", c)]
    assert len(installs) == 1 and "--no-deps" in installs[0].split(), installs
    assert "--require-hashes -r requirements/kserve.txt" in installs[0], installs
    assert any("-m pip check" in c for c in commands[commands.index(installs[0]):]), "no `pip check` after the install"


def test_make_ray_venv_installs_the_ray_lock_and_the_project_without_torch(tmp_path):
    """Ray Serve's venv (requirements/ray.in): its lock with its hashes (Ray and the serving set), then the project,
    each --no-deps, no torch; `pip check` after."""
    commands = _make_dry_run("ray-venv", f"RAY_VENV={tmp_path / 'ray'}")
    installs = [c for c in commands if re.search(r"\bpip install\b", c)]
    assert all("--no-deps" in c.split() for c in installs), installs
    assert ["--require-hashes -r requirements/ray.txt" in c for c in installs] == [True, False], installs
    assert installs[1].endswith("-e ."), installs
    assert not any("torch" in c for c in installs), installs
    assert any("-m pip check" in c for c in commands[commands.index(installs[-1]):]), "no `pip check` after the installs"


def _run_instructions(dockerfile: str) -> list[str]:
    text = re.sub(r"\\\n", " ", (ROOT / "deploy" / dockerfile).read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize(("dockerfile", "lock"), [("Dockerfile", "serving.txt"), ("Dockerfile.gpu", "serving-gpu.txt"),
                                                  ("Dockerfile.locust", "locust.txt")])
def test_every_dockerfile_installs_its_lock_and_nothing_unlocked(dockerfile, lock):
    instructions = _run_instructions(dockerfile)
    copied = {}  # destination -> source of the COPY instructions
    for instruction in instructions:
        if instruction.startswith("COPY") and "--from=" not in instruction:
            *sources, destination = instruction.split()[1:]
            for source in sources:
                copied[destination.rstrip("/") + "/" + Path(source).name if destination.endswith("/") else destination] \
                    = source
    installs = [part.strip() for i in instructions if i.startswith("RUN") for part in i[3:].split("&&")
                if re.search(r"\bpip install\b", part)]
    assert installs, f"{dockerfile}: no pip install"
    lock_files = []
    for install in installs:
        words = install.split()
        assert "--no-deps" in words, f"{dockerfile}: an install that resolves dependencies: {install}"
        if "-r" in words:
            assert "--require-hashes" in words, f"{dockerfile}: a lock installed without its hashes: {install}"
            lock_files.append(copied.get(words[words.index("-r") + 1]))
        else:
            assert words[-1] == ".", f"{dockerfile}: installs something that is neither a lock nor the project: {install}"
    assert lock_files == [f"requirements/{lock}"], f"{dockerfile}: installs {lock_files}, not requirements/{lock}"


def test_the_running_environment_holds_the_dev_lock():
    """The suite runs on exactly the locked versions (`make venv`): every package of dev.txt is installed at its
    locked version, and torch at its pin."""
    wrong = {}
    for name, entry in read_lock(REQUIREMENTS / "dev.txt").items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed is None or Version(installed) != Version(entry.version):
            wrong[name] = (installed, entry.version)
    assert not wrong, f"installed vs locked (run `make venv`): {wrong}"
    assert torch_pin().specifier.contains(metadata.version("torch"))
