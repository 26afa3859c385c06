"""The model registry: a model that failed to load is reported as failed, with its error, whether it was
configured by name or by name:version (the errors are kept under the configured spec)."""

from __future__ import annotations

import shutil
import time

import pytest

from service.errors import Unavailable
from service.observability.metrics import Metrics
from service.models.registry import ModelRegistry
from service.settings import Settings

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("spec", ["gpt", "gpt:1"])
def test_a_model_that_failed_to_load_says_why(tiny_repository, tmp_path, spec):
    repository = tmp_path / "repository"
    shutil.copytree(tiny_repository / "gpt", repository / "gpt")
    (repository / "gpt" / "1" / "decoder.onnx").write_bytes(b"not an onnx graph")
    registry = ModelRegistry(Settings(repository=repository, models=[spec]), Metrics())
    registry.start_loading()
    deadline = time.monotonic() + 30
    while registry.pending and time.monotonic() < deadline:
        time.sleep(0.05)
    ready, reasons = registry.readiness()
    assert not ready and any(reason.startswith(f"failed to load {spec}") for reason in reasons), reasons
    with pytest.raises(Unavailable) as raised:
        registry.resolve("gpt", None, None)
    message = raised.value.message
    assert "not configured" not in message and f"{spec}:" in message, message
    registry.stop(timeout=1)
