"""The `batcher` fixture of the continuous batcher's fault and contract tests (tests/support/batchers.py)."""

import pytest

from tests.support.batchers import BatcherFactory


@pytest.fixture
def batcher():
    factory = BatcherFactory()
    yield factory
    factory.close()
