"""The app in-process, for the tests that need no real socket: a FastAPI `TestClient` over `create_app(settings)`
with its lifespan running, handed over once `/health/ready` says the models are loaded.
(The real-process counterpart is `tests.support.server`.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

READY_TIMEOUT_S = 60.0  # loading and warming the tiny models in-process, on a busy machine
READY_POLL_S = 0.1


@contextmanager
def serving(settings) -> Iterator:
    """`with serving(settings) as client:` a TestClient over the app, once it is ready."""
    from fastapi.testclient import TestClient

    from service.app import create_app

    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while client.get("/health/ready").status_code != 200:
            assert time.monotonic() < deadline, client.get("/health/ready").json()
            time.sleep(READY_POLL_S)
        yield client
