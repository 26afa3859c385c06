"""Request priority on every API (docs/priority.md): the native routes' and OpenAI's `priority` (vLLM's: a level, 0
the most urgent), the Open Inference Protocol's `priority` parameter (Triton's: 0 the model's default, 1 the most
urgent), over REST; a level outside the configured ones is a 400 naming the field; the wait is recorded by level
(`tserve_priority_queue_wait_seconds`); the output does not depend on it."""

from __future__ import annotations

import pytest

from service.api.native.protocol import EXAMPLE_PNG_BASE64 as PNG
from service.settings import Settings
from tests.support.metrics import scrape

pytestmark = pytest.mark.slow

GREEDY = {"prompt": "ROMEO:\n", "max_new_tokens": 6, "temperature": 0}


def _levels_waited(client) -> set[str]:
    return {s.labels["priority"] for s in scrape(client) if s.name == "tserve_priority_queue_wait_seconds_count"}


def test_every_api_takes_a_priority_and_it_changes_no_output(tiny_repository, serving):
    settings = Settings(repository=tiny_repository, models=["gpt", "translation", "vit"], priority_levels=3,
                        default_priority="1,vit=2")
    with serving(settings) as client:
        plain = client.post("/v1/generate", json=GREEDY)
        urgent = client.post("/v1/generate", json={**GREEDY, "priority": 0})
        assert plain.status_code == urgent.status_code == 200, urgent.text
        assert plain.json()["text"] == urgent.json()["text"]
        translated = client.post("/v1/translate", json={"text": "Ein Mann.", "num_beams": 2, "priority": 2})
        assert translated.status_code == 200, translated.text
        classified = client.post("/v1/classify", json={"images": [PNG], "priority": 0})
        assert classified.status_code == 200, classified.text
        completion = client.post("/v1/completions", json={"model": "gpt", "prompt": "ROMEO:\n", "max_tokens": 4,
                                                          "temperature": 0, "priority": 0})
        assert completion.status_code == 200, completion.text
        assert "priority" not in completion.headers.get("X-Ignored-Fields", "")
        oip = client.post("/v2/models/gpt/infer", json={
            "parameters": {"max_new_tokens": 4, "temperature": 0, "priority": 1},
            "inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": ["ROMEO:\n"]}]})
        assert oip.status_code == 200, oip.text
        assert {"0", "1", "2"} <= _levels_waited(client)  # urgent requests, the GPT's default, the translation's


@pytest.mark.parametrize(("path", "body", "named"), [
    ("/v1/generate", {**GREEDY, "priority": 3}, "priority"),
    ("/v1/translate", {"text": "Ein Mann.", "priority": -1}, "priority"),
    ("/v1/completions", {"model": "gpt", "prompt": "x", "max_tokens": 2, "priority": 7}, "priority"),
    ("/v2/models/gpt/infer", {"parameters": {"priority": 9},
                              "inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": ["x"]}]},
     "priority"),
    ("/v2/models/gpt/infer", {"parameters": {"priority": "high"},
                              "inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": ["x"]}]},
     "priority"),
])
def test_a_level_outside_the_configured_ones_is_a_400_naming_the_field(tiny_repository, serving, path, body, named):
    with serving(Settings(repository=tiny_repository, models=["gpt", "translation"], priority_levels=3)) as client:
        response = client.post(path, json=body)
        assert response.status_code in (400, 422), response.text
        assert named in response.text
