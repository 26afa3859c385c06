"""Fixtures of the model-loading tests: the tiny GPT offering a checked int8 variant, so that a start calibrates."""

from __future__ import annotations

import json

import pytest

from service.repository import ModelRepository


@pytest.fixture(scope="module")
def gpt_with_int8(tiny_repository_copy):
    """The tiny GPT (stored float32) whose config records a checked int8 variant (a private copy per module)."""
    repository = tiny_repository_copy("variants", ["gpt"])
    config_path = repository / "gpt" / "1" / "config.json"
    config = json.loads(config_path.read_text())
    config["variants"] = {"int8": {"derived_from": "fp32", "metric": "val_loss", "measured": 2.2}}
    config_path.write_text(json.dumps(config))
    return ModelRepository(repository).get("gpt", 1)
