"""Skips made visible: every session ends with the list of the tests it skipped and why, and under CI
(TSERVE_REQUIRE_TOOLS=1, which .ci/run sets) a skip that is not on `ALLOWED_SKIPS` fails the session: a skipped test
is one nobody ran, and CI must not go green on it.

tests/conftest.py registers `SkipReport` (the hooks) for every session; `allowed` is the matching. Both are tested in
tests/test_skip_report.py, the matching on its own and the hooks in a real pytest session.
"""

from __future__ import annotations

import os

import pytest

# The skips CI accepts: (the start of the skip's reason, why that skip is legitimate under CI). Keep it short: each
# entry is a test CI never runs.
ALLOWED_SKIPS = (
    # tests/conftest.py `full_data_dir`: CI has no ../shared/data and does not run `make data` (the suite trains and
    # tests on the committed fixtures); the full sets' tests run on a developer's machine that has them
    ("needs the full data sets: ",
     "the full data sets are absent: CI has no ../shared/data and does not run `make data`"),
    # tests/gpu/conftest.py: CI's machines have no GPU; those tests run by `make gpu-check` on an NVIDIA machine
    # (docs/gpu.md), whose report says whether they passed
    ("needs a CUDA GPU: ",
     "CI has no GPU: the CUDA tests (tests/gpu) run in `make gpu-check` on an NVIDIA machine (docs/gpu.md)"),
    # tests/deploy/test_kserve.py: KServe's CRDs are read from ../shared/kserve-crds, never copied into the project, and
    # CI has no ../shared; the manifests' agreement with the service and the Deployment is checked there all the same
    ("needs KServe's CRDs: ",
     "CI has no ../shared/kserve-crds: the KServe manifests are validated against KServe's CRDs where it exists"),
)
REQUIRE_ENV = "TSERVE_REQUIRE_TOOLS"


def allowed(reason: str) -> str | None:
    """Why a skip with this reason is accepted under CI (its `ALLOWED_SKIPS` entry), or None when it is not."""
    return next((why for prefix, why in ALLOWED_SKIPS if reason.startswith(prefix)), None)


def required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def _reason(report) -> str:
    longrepr = report.longrepr  # a skip's: (path, line, "Skipped: <reason>")
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


class SkipReport:
    """The plugin (tests/conftest.py registers one per session): collects the skips, lists them last, and under CI
    turns a passing session with a skip off the allowlist into a failing one."""

    def __init__(self):
        self.skips: list[tuple[str, str]] = []  # (node id, reason), in the order they happened

    def disallowed(self) -> list[tuple[str, str]]:
        return [(nodeid, reason) for nodeid, reason in self.skips if allowed(reason) is None]

    def pytest_runtest_logreport(self, report):
        if report.skipped and not hasattr(report, "wasxfail"):  # an xfail is reported as skipped: not a skip
            self.skips.append((report.nodeid, _reason(report)))

    def pytest_collectreport(self, report):  # a module skipped whole (pytest.skip(allow_module_level=True))
        if report.skipped:
            self.skips.append((report.nodeid, _reason(report)))

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_terminal_summary(self, terminalreporter):
        """After pytest's own summary (whose short summary folds skips by place), every skipped test, one line each,
        just above the final counts."""
        result = yield
        if self.skips:
            enforced = required()
            terminalreporter.section(f"skipped tests ({len(self.skips)})", sep="=", bold=True)
            for nodeid, reason in self.skips:
                verdict = "  [allowed under CI]" if allowed(reason) else "  [NOT ALLOWED under CI]" if enforced else ""
                terminalreporter.line(f"SKIPPED {nodeid}: {reason}{verdict}")
            for why in dict.fromkeys(filter(None, (allowed(reason) for _, reason in self.skips))):
                terminalreporter.line(f"allowed under CI: {why}")
            bad = self.disallowed()
            if enforced and bad:
                terminalreporter.line(f"{REQUIRE_ENV} is set: {len(bad)} skip(s) not on the allowlist "
                                      "(tests/support/skips.py, ALLOWED_SKIPS) fail the session", red=True, bold=True)
        return result

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        """Under CI, a session that passed but skipped a test off the allowlist exits 1 (tests failed)."""
        if required() and exitstatus == pytest.ExitCode.OK and self.disallowed():
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
