"""Session-wide fixtures: the data folder and the three `tiny` presets trained once through the real CLI.

`TSERVE_TEST_CACHE=DIR` keeps the tiny runs and their repository in DIR between test sessions (for quick
iterations while developing; CI leaves it unset and trains afresh).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from models.data import resolve_data_dir

PROJECT_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def data_dir() -> Path:
    explicit = os.environ.get("TSERVE_DATA_DIR")
    if explicit:
        return resolve_data_dir(explicit)
    beside_checkout = PROJECT_ROOT.parent / "shared" / "data"
    return resolve_data_dir(beside_checkout if beside_checkout.is_dir() else None)


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory, data_dir) -> dict[str, Path]:
    """Run folders of `python -m models.train <task> --preset tiny`, trained once per test session."""
    from models.train import main

    cache = os.environ.get("TSERVE_TEST_CACHE")
    root = Path(cache) / "runs" if cache else tmp_path_factory.mktemp("runs")
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

    cache = os.environ.get("TSERVE_TEST_CACHE")
    repository = Path(cache) / "repository" if cache else tmp_path_factory.mktemp("repository")
    for kind, run_dir in tiny_runs.items():
        if cache and (repository / kind / "1").is_dir():
            continue
        assert main([kind, "--checkpoint", str(run_dir), "--repository", str(repository),
                     "--data-dir", str(data_dir)]) == 0
    return repository


@contextmanager
def _serving(settings):
    from fastapi.testclient import TestClient

    from service.app import create_app

    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 60
        while client.get("/health/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/health/ready").json()
            time.sleep(0.1)
        yield client


@pytest.fixture(scope="session")
def serving():
    """`with serving(settings) as client:` a TestClient over the app (lifespan running), once /health/ready says
    the models are loaded."""
    return _serving
