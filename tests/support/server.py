"""A real server process for the tests: the shared launcher (`service.client.launcher.ServiceProcess`) with the
tests' defaults and pytest glue, and the output of the servers a failing test used.

tests/conftest.py builds on this: `server_factory` (a `ServerProcess` on the tiny repository in a fresh folder)
and the autouse fixture that prints, when a test fails, what its servers wrote.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from service.client.launcher import ServiceProcess, ServiceStartError

READY_TIMEOUT_S = 90.0  # loading the tiny models and warming them up on a busy 2-core machine
# The settings a server takes from the suite's environment (tests/conftest.py), unless a knob sets them: the launcher
# hands a server no TSERVE_* variable of its parent, so without this a server would calibrate its weights variant
# (the fastest on this CPU: int8 on one, float32 on another) where every in-process app runs the stored one, and
# outputs compared with a reference graph would depend on the CPU.
SUITE_SETTINGS = ("variant", "calibration_cache")
# When a failing test got nothing new from a server that is still running (a shared one), the last lines it wrote
# before the test are shown instead: enough to see what it was doing.
LAST_LINES_SHOWN = 60

_SERVERS: list[ServerProcess] = []  # every server the session made, for the output of a failing test


class ServerProcess(ServiceProcess):
    """`ServiceProcess` as the tests use it: `(name, repository, workdir, **knobs)`, no drain delay unless a knob
    says so, the suite's `SUITE_SETTINGS`, idle threads that sleep; a server that does not start fails the test
    with its output, and `output_on_failure` prints what the servers wrote during a failing test."""

    def __init__(self, name: str, repository: Path, workdir: Path, **knobs):
        knobs.setdefault("drain_delay_s", 0)  # a test stops its servers at once unless it tests the drain
        for setting in SUITE_SETTINGS:
            if f"TSERVE_{setting.upper()}" in os.environ:
                knobs.setdefault(setting, os.environ[f"TSERVE_{setting.upper()}"])
        super().__init__(name, repository, workdir, env={"OMP_WAIT_POLICY": "PASSIVE"}, ready_timeout=READY_TIMEOUT_S,
                         **knobs)
        _SERVERS.append(self)

    def start(self, timeout: float | None = None) -> ServerProcess:
        try:
            return super().start(timeout)
        except ServiceStartError as error:
            message = str(error)
        pytest.fail(message)


@contextmanager
def output_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """Around one test: if it fails, print the output of the servers it used (pytest shows it as 'Captured stdout
    teardown'): what each wrote during the test, or the last lines of a shared server that wrote nothing new."""
    failed_before = request.session.testsfailed
    marks = {id(s): (len(s.stdout), len(s.stderr)) for s in _SERVERS}
    yield
    if request.session.testsfailed > failed_before:
        for server in _SERVERS:
            since = marks.get(id(server), (0, 0))
            if (len(server.stdout), len(server.stderr)) == since:
                if server.proc is None or server.proc.poll() is not None:
                    continue  # finished before this test
                since = (max(0, since[0] - LAST_LINES_SHOWN), max(0, since[1] - LAST_LINES_SHOWN))
            print(server.output(since))
