"""Model control against versions nobody should load and unloads that cut requests short (issue 51), through the
ASGI app on a private copy of the tiny repository:

- item 6: a version holding another model's tokenizer.json (the translator with the GPT's, the GPT with the
  translator's) is refused with a 400 naming the mismatch, listed UNAVAILABLE with the reason, and the serving
  version serves on (it used to load READY and translate into bytes);
- item 12: a version unloaded while its requests run past TSERVE_DRAIN_TIMEOUT_S tells them their version was
  unloaded (503 `model_unloaded`, failure reason `unloaded`), streamed or not, never that the server shut down,
  and the server serves on.
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import pytest

from service.settings import Settings
from tests.support.waiting import PATIENCE_S, poll

pytestmark = pytest.mark.slow

DRAIN_S = 0.3  # TSERVE_DRAIN_TIMEOUT_S: short, the held requests cannot finish within it whatever it is
HOLD_POLL_S = 0.01  # how often a held prompt pass looks whether its scheduler has stopped
GENERATE = {"prompt": "ROMEO:\n", "max_new_tokens": 50, "temperature": 0}


@pytest.fixture(scope="module")
def repository(tiny_repository_copy):
    return tiny_repository_copy("control-hostile-repository", ("gpt", "translation"))


@pytest.fixture(scope="module")
def client(repository, serving):
    with serving(Settings(repository=repository, model_control=True, drain_timeout_s=DRAIN_S)) as client:
        yield client


def error_message(response) -> str:
    error = response.json()["error"]
    return error if isinstance(error, str) else error["message"]


def index_entry(client, name: str, version: str) -> dict:
    response = client.post("/v2/repository/index")
    assert response.status_code == 200, response.text
    return next(e for e in response.json() if (e["name"], e["version"]) == (name, version))


# --- item 6: a tokenizer of another model -------------------------------------------------------------------------

SWAPS = {  # model, the model whose tokenizer.json it gets, what the refusal names
    "the translator with the GPT's tokenizer": ("translation", "gpt", "special_tokens.pad_id is 0"),
    "the GPT with the translator's tokenizer": ("gpt", "translation", "tokenizer.json"),
}
SERVES = {"translation": ("/v1/translate", {"text": "Ein Hund."}), "gpt": ("/v1/generate", GENERATE)}


@pytest.mark.parametrize("case", list(SWAPS))
def test_a_version_with_another_models_tokenizer_is_refused_naming_the_mismatch(client, repository, case):
    name, donor, names = SWAPS[case]
    folder = repository / name / "2"
    shutil.copytree(repository / name / "1", folder)
    try:
        shutil.copyfile(repository / donor / "1" / "tokenizer.json", folder / "tokenizer.json")
        response = client.post(f"/v2/repository/models/{name}/load", json={"parameters": {"version": "2"}})
        assert response.status_code == 400, response.text
        message = error_message(response)
        assert names in message and "the tokenizer belongs to another model" in message, message
        entry = index_entry(client, name, "2")
        assert entry["state"] == "UNAVAILABLE" and names in entry["reason"], entry
        path, body = SERVES[name]
        served = client.post(path, json=body)
        assert served.status_code == 200 and served.json()["version"] == 1, served.text
    finally:
        shutil.rmtree(folder)


# --- item 12: an unload past the drain timeout ----------------------------------------------------------------------

def _sse_events(body: bytes) -> list:
    lines = [line.removeprefix(b"data: ") for line in body.split(b"\n") if line.startswith(b"data: ")]
    return [line.decode() if line == b"[DONE]" else json.loads(line) for line in lines]


def test_a_version_unloaded_past_its_drain_timeout_tells_its_requests_it_was_unloaded(client, repository,
                                                                                      monkeypatch):
    shutil.copytree(repository / "gpt" / "1", repository / "gpt" / "3")
    try:
        assert client.post("/v2/repository/models/gpt/load", json={"parameters": {"version": "3"}}).status_code == 200
        loaded = client.app.state.registry.loaded[("gpt", 3)]
        scheduler, real = loaded.scheduler, loaded.engine.prefill_cached

        def held(*args, **kwargs):  # the prompt pass waits for the scheduler's stop: no request can finish first
            while not scheduler._stop:
                time.sleep(HOLD_POLL_S)
            return real(*args, **kwargs)

        monkeypatch.setattr(loaded.engine, "prefill_cached", held)
        outcomes: dict[str, object] = {}

        def plain() -> None:
            outcomes["plain"] = client.post("/v1/generate", json={**GENERATE, "version": 3})

        def streamed() -> None:
            with client.stream("POST", "/v1/generate", json={**GENERATE, "version": 3, "stream": True}) as response:
                outcomes["streamed"] = (response.status_code, _sse_events(response.read()))

        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for thread in threads:
            thread.start()
        poll(lambda: scheduler.queue_depth + len(scheduler._in_flight()) + scheduler.running == 2, PATIENCE_S,
             message="both requests in the scheduler of gpt version 3")
        unloaded = client.post("/v2/repository/models/gpt/unload", json={"parameters": {"version": "3"}})
        assert unloaded.status_code == 200, unloaded.text
        for thread in threads:
            thread.join(PATIENCE_S)

        plain_response = outcomes["plain"]
        assert plain_response.status_code == 503, plain_response.text
        error = plain_response.json()["error"]
        assert error["type"] == "model_unloaded", error
        status, events = outcomes["streamed"]
        assert status == 200 and events[-1] == "[DONE]", events
        stream_error = events[-2]["error"]
        assert stream_error["type"] == "model_unloaded", events
        for message in (error["message"], stream_error["message"]):
            assert message.startswith("model 'gpt' version 3 was unloaded before this request finished"), message
            assert f"TSERVE_DRAIN_TIMEOUT_S={DRAIN_S:g}" in message and "shut down" not in message, message
        metrics = client.get("/metrics").text
        assert 'tserve_request_failures_total{model="gpt",reason="unloaded",version="3"} 2.0' in metrics, \
            [line for line in metrics.splitlines() if line.startswith("tserve_request_failures_total")]
        # the server serves on, with the version left
        generated = client.post("/v1/generate", json=GENERATE)
        assert generated.status_code == 200 and generated.json()["version"] == 1, generated.text
        assert client.get("/health/ready").status_code == 200
    finally:
        shutil.rmtree(repository / "gpt" / "3")
