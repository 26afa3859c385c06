"""A bounded wait: call a condition until it holds, failing the test (with what it waited for) at the timeout.
Every wait in the server tests is one of these, never a bare sleep."""

from __future__ import annotations

import time

import pytest

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
