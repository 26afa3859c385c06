"""A bounded wait: call a condition until it holds, failing the test (with what it waited for) at the timeout.
Every wait in the server tests is one of these, never a bare sleep."""

from __future__ import annotations

import os
import time

import pytest

# How long a test waits for what arrives within milliseconds when the code is right (a result, a step, a stop), busy
# CI machines included. `make mutation` sets TSERVE_TEST_PATIENCE_S to a few seconds (mutation/run.py): a mutant
# that hangs a scheduler then fails its test in seconds instead of after the full wait.
PATIENCE_S = float(os.environ.get("TSERVE_TEST_PATIENCE_S", "30"))
POLL_INTERVAL_S = 0.05  # short beside the tiny models' ~20 ms generations, long enough not to load the server


def poll(condition, timeout: float, interval: float = POLL_INTERVAL_S, message: str = "condition"):
    """Call `condition()` until it returns something truthy (returned), at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)
