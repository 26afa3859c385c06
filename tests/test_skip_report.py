"""The skip report (tests/support/skips.py, registered by tests/conftest.py): the allowlist's matching, and real
pytest sessions run with this suite's conftest as a plugin: every skip listed last with its reason, and under CI
(TSERVE_REQUIRE_TOOLS=1) a skip off the allowlist failing a session whose tests all passed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.support import ROOT
from tests.support.skips import ALLOWED_SKIPS, allowed

SESSION = """
import pytest

def test_passes():
    pass

def test_full_sets(full_data_dir):  # the real fixture: TSERVE_DATA_DIR names a folder that does not exist
    pass

def test_tool():
    pytest.skip("`nginx` not found on PATH: install it with `sudo apt-get install nginx`")

@pytest.mark.parametrize("case", [])
def test_empty(case):
    pass

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False
"""


@pytest.mark.parametrize(("reason", "accepted"), [
    ("needs the full data sets: no data folder at /x/data (default); get them with `make data`", True),
    ("needs a CUDA GPU: a session asked for CUDA runs on CPUExecutionProvider", True),  # tests/gpu; CI has no GPU
    ("needs KServe's CRDs: /x/shared/kserve-crds is absent", True),  # tests/deploy/test_kserve.py; CI has no ../shared
    ("the GPU: needs a CUDA GPU: elsewhere in the reason", False),
    ("got empty parameter set for (model)", False),  # a parametrization empty on every machine
    ("`nginx` not found on PATH: install it with `sudo apt-get install nginx` (deploy/ci-packages.txt)", False),
    ("no Docker daemon answers at /var/run/docker.sock: start one", False),
    ("the data: needs the full data sets: elsewhere in the reason", False),  # a prefix, not a substring
    ("", False),
])
def test_allowlist_matches_by_reason_prefix(reason, accepted):
    assert (allowed(reason) is not None) is accepted


def test_every_allowlist_entry_says_why():
    assert 0 < len(ALLOWED_SKIPS) <= 5, "a short allowlist"
    assert all(prefix.strip() and len(why) > 20 for prefix, why in ALLOWED_SKIPS)


def _session(tmp_path, source: str, require: bool, **more: str) -> subprocess.CompletedProcess:
    """pytest on tmp_path's test_session.py (and test_<name>.py for each of `more`), this suite's conftest loaded."""
    for name, text in {"session": source, **more}.items():
        (tmp_path / f"test_{name}.py").write_text(textwrap.dedent(text))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TSERVE_DATA_DIR": str(tmp_path / "no-data")}
    env.pop("TSERVE_REQUIRE_TOOLS", None)
    if require:
        env["TSERVE_REQUIRE_TOOLS"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
                           "-ra"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def _skip_section(output: str) -> list[str]:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if "skipped tests (" in line)
    assert any("short test summary info" in line for line in lines[:start]), "the list is not after the summary"
    assert "passed" in lines[-1], f"the final counts are not the last line: {lines[-1]}"
    return lines[start:-1]


def test_a_session_lists_every_skip_last(tmp_path):
    done = _session(tmp_path, SESSION, require=False)
    assert done.returncode == 0, done.stdout + done.stderr
    section = _skip_section(done.stdout)
    assert "skipped tests (3)" in section[0]
    listed = [line for line in section[1:] if line.startswith("SKIPPED ")]
    assert [line.split(": ", 1)[0].split("[")[0] for line in listed] == [  # the node ids, less the parameter id
        "SKIPPED test_session.py::test_full_sets", "SKIPPED test_session.py::test_tool",
        "SKIPPED test_session.py::test_empty"]
    assert "needs the full data sets: " in listed[0] and "`nginx` not found on PATH" in listed[1]
    assert "got empty parameter set" in listed[2]
    assert "NOT ALLOWED" not in done.stdout  # off CI a skip is reported, not judged


def test_under_ci_a_skip_off_the_allowlist_fails_the_session(tmp_path):
    done = _session(tmp_path, SESSION, require=True)
    assert done.returncode == 1, done.stdout + done.stderr
    section = _skip_section(done.stdout)
    listed = [line for line in section if line.startswith("SKIPPED ")]
    assert listed[0].endswith("[allowed under CI]") and "needs the full data sets: " in listed[0]
    assert "allowed under CI: the full data sets are absent: CI has no ../shared/data" in "\n".join(section)
    assert listed[1].endswith("[NOT ALLOWED under CI]") and listed[2].endswith("[NOT ALLOWED under CI]")
    assert "2 skip(s) not on the allowlist" in done.stdout


def test_under_ci_allowed_skips_pass(tmp_path):
    done = _session(tmp_path, "def test_passes():\n    pass\n\n"
                              "def test_full_sets(full_data_dir):\n    pass\n", require=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 1 skipped" in done.stdout.splitlines()[-1]


def test_under_ci_a_module_skipped_whole_fails_too(tmp_path):
    done = _session(tmp_path, "import pytest\n\npytest.skip('no daemon', allow_module_level=True)\n", require=True,
                    other="def test_passes():\n    pass\n")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "SKIPPED test_session.py: no daemon  [NOT ALLOWED under CI]" in done.stdout
