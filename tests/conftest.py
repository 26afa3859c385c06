"""Session-wide fixtures: the data folders and the three `tiny` presets trained once through the real CLI.

`data_dir` is ALWAYS the committed fixtures, tests/fixtures/data (the first few hundred examples of each split,
made by tests/fixtures/make_fixtures.py), so CI and every developer's machine run the same tests on the same data.
`full_data_dir` is the full data sets, for the few tests that need them: $TSERVE_DATA_DIR, else ../shared/data
beside the checkout, else ./data (models.data's order); those tests are skipped, naming what is missing and
`make data`, when it is absent.

`TSERVE_TEST_CACHE=DIR` keeps the tiny runs and their repository in DIR between test sessions (for quick
iterations while developing; CI leaves it unset and trains afresh). They live under a folder named by a
fingerprint of the tiny presets and the fixture data, so changing either trains afresh.

The servers, built on tests/support/: `serving` (the app in-process, a TestClient) and `server_factory` (a real
`python -m service` process, `tests.support.server.ServerProcess`); when a test fails, the autouse
`_print_server_output_on_failure` prints what the server processes it used wrote.
`tiny_repository_copy` makes a private repository from the tiny one's versions, for tests that change it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest

from models.datasets import ENV_VAR
from tests.support import ROOT
from tests.support.app import serving as _serving
from tests.support.repository import SOURCE_VERSION, copy_versions
from tests.support.server import ServerProcess, output_on_failure

# The in-process apps (`serving`, create_app in a test) serve no gRPC port unless a test's settings ask for one:
# many of them start and stop in one session, and TSERVE_GRPC_PORT's default (8001) is one port.
os.environ.setdefault("TSERVE_GRPC_PORT", "0")
# Every server and app of the suite runs each model's stored weights variant unless a test pins or calibrates
# (service.models.variants): outputs compared with references must not depend on which variant this CPU is
# fastest with; and none keeps calibration timings in the user's home.
os.environ.setdefault("TSERVE_VARIANT", "stored")
os.environ.setdefault("TSERVE_CALIBRATION_CACHE", "")

FIXTURE_DATA = ROOT / "tests" / "fixtures" / "data"
_MAKE_DATA = "get them with `make data` (or set TSERVE_DATA_DIR to a folder that holds them)"


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The committed data fixtures, whatever TSERVE_DATA_DIR says (tests/fixtures/README.md)."""
    assert (FIXTURE_DATA / "multi30k" / "train.de.gz").is_file(), \
        f"{FIXTURE_DATA} is missing: regenerate it with `python tests/fixtures/make_fixtures.py FULL_DATA_DIR`"
    return FIXTURE_DATA


def find_full_data() -> tuple[Path | None, str]:
    """(the full data folder, "") or (None, why it is not usable): the folder models.data would resolve to, which
    must hold every file `make data` fetches."""
    from models.datasets import FILES

    explicit = os.environ.get(ENV_VAR)
    if explicit:
        folder, how = Path(explicit), ENV_VAR
    else:
        beside_checkout = ROOT.parent / "shared" / "data"
        folder, how = (beside_checkout, "default") if beside_checkout.is_dir() else (ROOT / "data", "default")
    if not folder.is_dir():
        return None, f"no data folder at {folder.absolute()} ({how})"
    if folder.resolve() == FIXTURE_DATA.resolve():
        return None, f"{folder} ({how}) is the test fixtures, not the full sets"
    missing = [f.path for f in FILES if not (folder / f.path).is_file()]
    if missing:
        return None, f"{folder.absolute()} ({how}) lacks {', '.join(missing)}"
    return folder.resolve(), ""


@pytest.fixture(scope="session")
def full_data_dir() -> Path:
    """The full data sets (Multi30k, tinyshakespeare, Fashion-MNIST); skips the test when they are absent."""
    folder, problem = find_full_data()
    if folder is None:
        pytest.skip(f"needs the full data sets: {problem}; {_MAKE_DATA}")
    return folder


def _cache_key() -> str:
    """Fingerprint of what the cached tiny runs depend on: the tiny presets, the fixture files, and the code that
    trains, evaluates and exports them (models/, export/)."""
    from models.config import PRESETS

    digest = hashlib.sha256()
    for folder in ("models", "export"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            digest.update(path.relative_to(ROOT).as_posix().encode() + path.read_bytes())
    for task in ("translation", "gpt", "vit"):
        model_cfg, train_cfg = PRESETS[task]["tiny"]
        digest.update(json.dumps([task, dataclasses.asdict(model_cfg), dataclasses.asdict(train_cfg)],
                                 sort_keys=True, default=str).encode())
    for path in sorted(FIXTURE_DATA.rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(FIXTURE_DATA).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def _cache_root() -> Path | None:
    cache = os.environ.get("TSERVE_TEST_CACHE")
    return Path(cache) / f"tiny-{_cache_key()}" if cache else None


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory, data_dir) -> dict[str, Path]:
    """Run folders of `python -m models.train <task> --preset tiny` on the fixtures, trained once per session."""
    from models.train import main

    cache = _cache_root()
    root = cache / "runs" if cache else tmp_path_factory.mktemp("runs")
    runs = {}
    for task in ("translation", "gpt", "vit"):
        out = root / f"{task}-tiny"
        runs[task] = out
        if cache and (out / "metrics.json").exists():
            continue
        assert main([task, "--preset", "tiny", "--data-dir", str(data_dir), "--out", str(out), "--quiet"]) == 0
    return runs


@pytest.fixture(scope="session")
def tiny_repository(tmp_path_factory, tiny_runs, data_dir) -> Path:
    """A model repository with version 1 of each tiny model, exported (and parity-checked) by the real CLI."""
    from export.__main__ import main

    cache = _cache_root()
    repository = cache / "repository" if cache else tmp_path_factory.mktemp("repository")
    for kind, run_dir in tiny_runs.items():
        if cache and (repository / kind / "1").is_dir():
            continue
        assert main([kind, "--checkpoint", str(run_dir), "--repository", str(repository),
                     "--data-dir", str(data_dir)]) == 0
    return repository


@pytest.fixture(scope="session")
def tiny_repository_copy(tiny_repository, tmp_path_factory):
    """`tiny_repository_copy(name, kinds, versions=("1",))`: a private model repository in a fresh folder, with
    version 1 of each model in `kinds` from the tiny repository as each of `versions` (`copy_versions`)."""

    def make(name: str, kinds, versions=(SOURCE_VERSION,)) -> Path:
        return copy_versions(tiny_repository, tmp_path_factory.mktemp(name), kinds, versions)

    return make


@pytest.fixture(scope="session")
def serving():
    """`with serving(settings) as client:` a TestClient over the app (lifespan running), once /health/ready says
    the models are loaded."""
    return _serving


@pytest.fixture(scope="session")
def server_factory(tiny_repository, tmp_path_factory):
    """`with server_factory(name, **knobs) as server:` a real server process (`ServerProcess`: started on entry,
    stopped on exit) on the tiny repository, or on `repository=`, in a fresh folder; knobs are settings
    (TSERVE_<NAME>). A module-scoped fixture wraps it to share one server among a module's tests."""

    def make(name: str, repository: Path | None = None, **knobs) -> ServerProcess:
        workdir = tmp_path_factory.mktemp(name.replace(" ", "-"))
        return ServerProcess(name, repository or tiny_repository, workdir, **knobs)

    return make


@pytest.fixture(autouse=True)
def _print_server_output_on_failure(request):
    """On a failing test, print the output of the server processes it used (`output_on_failure`)."""
    with output_on_failure(request):
        yield


# --- skips: listed at the end of every session; under CI (TSERVE_REQUIRE_TOOLS=1) one off the allowlist fails it ---


def pytest_configure(config):
    """The skip report (tests/support/skips.py): every skipped test and why, last; `ALLOWED_SKIPS` under CI."""
    from tests.support.skips import SkipReport

    config.pluginmanager.register(SkipReport(), "tserve-skip-report")
