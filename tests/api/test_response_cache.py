"""The response cache over HTTP (docs/response_cache.md), on the tiny models in-process: off by default; a parameter
fuzz per model kind (change any one parameter of a request: a miss, computed; repeat it exactly: a hit with the same
bytes, answered without the scheduler: its submitted jobs unchanged); what does not change the answer (priority,
deadline, the API that carried it) is a hit; sampling without a seed is never cached; a stream replays a hit and
stores what it ran; the config routes and Triton's statistics say so. Eviction: tests/unit/response_cache; Redis:
tests/api/test_response_cache_redis.py."""

from __future__ import annotations

import base64
import json
import queue

import numpy as np
import pytest
import tritonclient.grpc as tgrpc

from service.client.processes import free_port
from service.settings import Settings
from tests.support.images import png_bytes
from tests.support.repository import copy_versions
from tests.support.triton_inputs import grpc_text_input

pytestmark = pytest.mark.slow

RNG = np.random.default_rng(57)
IMAGES = [base64.b64encode(png_bytes(RNG.integers(0, 256, (28, 28), dtype=np.uint8))).decode() for _ in range(2)]
TRANSLATE = {"text": "Ein Mann fährt mit dem Fahrrad.", "num_beams": 2}
TRANSLATE_CHANGES = {"text": {"text": "Zwei Hunde spielen."}, "num_beams": {"num_beams": 3},
                     "length_penalty": {"length_penalty": 0.5}, "early_stopping": {"early_stopping": True},
                     "num_return_sequences": {"num_return_sequences": 2}, "max_new_tokens": {"max_new_tokens": 4},
                     "min_new_tokens": {"min_new_tokens": 3}, "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
                     "target_prefix": {"target_prefix": "A"}, "version": {"version": 1}}  # 2 answers by default
GREEDY = {"prompt": "ROMEO:\n", "max_new_tokens": 6, "temperature": 0}
GREEDY_CHANGES = {"prompt": {"prompt": "JULIET:\n"}, "max_new_tokens": {"max_new_tokens": 7},
                  "min_new_tokens": {"min_new_tokens": 6}, "repetition_penalty": {"repetition_penalty": 1.3},
                  "no_repeat_ngram_size": {"no_repeat_ngram_size": 2}, "stop": {"stop": ["e"]},
                  "num_beams": {"num_beams": 2}, "choice": {"choice": [" a", " b"]}, "regex": {"regex": "[a-z ]+"},
                  "json_schema": {"json_schema": {"type": "object"}}}
SAMPLED = {"prompt": "KING:\n", "max_new_tokens": 6, "temperature": 0.8, "seed": 3}
SAMPLED_CHANGES = {"seed": {"seed": 4}, "temperature": {"temperature": 0.9}, "top_k": {"top_k": 5},
                   "top_p": {"top_p": 0.8}}
COMPLETION = {"model": "gpt", "prompt": "ROMEO:\n", "max_tokens": 5, "temperature": 0}
COMPLETION_CHANGES = {"logprobs": {"logprobs": 2}, "n": {"n": 2},
                      "best_of": {"best_of": 2, "temperature": 0.7, "seed": 1}, "presence_penalty": {
                          "presence_penalty": 0.5}, "frequency_penalty": {"frequency_penalty": 0.5}}
CLASSIFY = {"images": [IMAGES[0]], "top_k": 3}
CLASSIFY_CHANGES = {"images": {"images": [IMAGES[1]]}, "two images": {"images": IMAGES}}
SCORE = {"source": "Ein Mann.", "target": "A man."}
SCORE_CHANGES = {"source": {"source": "Eine Frau."}, "target": {"target": "A woman."}}
UNCHANGED = {"priority": {"priority": 0}, "timeout_ms": {"timeout_ms": 9000}}  # when, never what
STREAM_WAIT_S = 30.0  # the longest one gRPC stream response may take on a busy machine


@pytest.fixture(scope="module")
def repository(tiny_repository, tmp_path_factory):
    """The tiny models, the translator in versions 1 and 2 (one more key to change)."""
    folder = copy_versions(tiny_repository, tmp_path_factory.mktemp("response-cache"), ["translation"], ["1", "2"])
    return copy_versions(tiny_repository, folder, ["gpt", "vit"])


def _settings(repository, **knobs) -> Settings:
    return Settings(repository=repository, grpc_port=0, variant="stored", calibration_cache="", **knobs)


class Submitted:
    """Jobs each loaded version's scheduler was given, counted by wrapping its `submit`."""

    def __init__(self, client):
        self.count = 0
        for loaded in client.app.state.registry.loaded.values():
            loaded.scheduler.submit = self._counting(loaded.scheduler.submit)

    def _counting(self, submit):
        def counted(job, *args, **kwargs):
            self.count += 1
            return submit(job, *args, **kwargs)
        return counted


@pytest.fixture(scope="module")
def cached(repository, serving):
    with serving(_settings(repository, response_cache="all", models=["translation:1", "translation:2", "gpt", "vit"])
                 ) as client:
        client.submitted = Submitted(client)
        yield client


def lookups(client, model: str) -> tuple[float, float]:
    """(hits, misses) of `model`, every version."""
    registry = client.app.state.metrics.registry
    return tuple(sum(registry.get_sample_value("tserve_response_cache_lookup_seconds_count",
                                               {"model": model, "version": str(v), "result": result}) or 0
                     for v in (1, 2)) for result in ("hit", "miss"))


def uncacheable(client, model: str) -> float:
    return client.app.state.metrics.registry.get_sample_value("tserve_response_cache_uncacheable_total",
                                                              {"model": model, "version": "1"})


def _body(response, volatile: tuple[str, ...] = ()) -> bytes:
    """The response's bytes, less the fields every answer makes afresh (OpenAI's `id`, `created`)."""
    assert response.status_code == 200, response.text
    if not volatile:
        return response.content
    return json.dumps({k: v for k, v in response.json().items() if k not in volatile}).encode()


def _fuzz(client, model: str, path: str, base: dict, changes: dict, volatile: tuple[str, ...] = ()) -> dict:
    """Each request (the base, then the base with one change) once: a miss that reached the scheduler; then again:
    a hit with the same bytes that did not. Returns each request's bytes."""
    seen = {}
    for name, change in [("base", {}), *changes.items()]:
        body = {**base, **change}
        before, jobs = lookups(client, model), client.submitted.count
        first = _body(client.post(path, json=body), volatile)
        middle = lookups(client, model)
        assert (middle[0] - before[0], middle[1] - before[1]) == (0, 1), f"{name}: not a miss"
        assert client.submitted.count > jobs, f"{name}: a miss must be computed"
        jobs = client.submitted.count
        again = _body(client.post(path, json=body), volatile)
        after = lookups(client, model)
        assert (after[0] - middle[0], after[1] - middle[1]) == (1, 0), f"{name}: not a hit"
        assert client.submitted.count == jobs, f"{name}: a hit reached the scheduler"
        assert again == first, f"{name}: the hit's bytes differ"
        seen[name] = first
    return seen


@pytest.mark.parametrize("model, path, base, changes, volatile", [
    ("translation", "/v1/translate", TRANSLATE, TRANSLATE_CHANGES, ()),
    ("gpt", "/v1/generate", GREEDY, GREEDY_CHANGES, ()),
    ("gpt", "/v1/generate", SAMPLED, SAMPLED_CHANGES, ()),
    ("gpt", "/v1/completions", COMPLETION, COMPLETION_CHANGES, ("id", "created")),
    ("vit", "/v1/classify", CLASSIFY, CLASSIFY_CHANGES, ()),
], ids=["translate", "generate-greedy", "generate-seeded", "openai-completions", "classify"])
def test_one_changed_parameter_is_a_miss_and_an_exact_repeat_a_hit_with_the_same_bytes(cached, model, path, base,
                                                                                       changes, volatile):
    _fuzz(cached, model, path, base, changes, volatile)


def test_scoring_is_cached_too_and_a_hit_takes_no_scoring_slot(cached):
    _fuzz_scores = {}
    for name, change in [("base", {}), *SCORE_CHANGES.items()]:
        before = lookups(cached, "translation")
        first = cached.post("/v1/translate/score", json={**SCORE, **change})
        again = cached.post("/v1/translate/score", json={**SCORE, **change})
        after = lookups(cached, "translation")
        assert (after[0] - before[0], after[1] - before[1]) == (1, 1), name
        assert first.status_code == 200 and again.content == first.content
        _fuzz_scores[name] = first.content
    assert len(set(_fuzz_scores.values())) == len(_fuzz_scores)


@pytest.mark.parametrize("path, base", [("/v1/translate", TRANSLATE), ("/v1/generate", GREEDY)])
def test_what_decides_only_when_a_request_runs_is_not_in_the_key(cached, path, base):
    reference = cached.post(path, json=base).content
    for name, change in UNCHANGED.items():
        hits = lookups(cached, "translation" if "translate" in path else "gpt")[0]
        assert cached.post(path, json={**base, **change}).content == reference, name
        assert lookups(cached, "translation" if "translate" in path else "gpt")[0] == hits + 1, name


def test_one_request_through_another_api_is_the_same_answer_and_a_hit(cached):
    native = cached.post("/v1/translate", json={"text": "Ein Hund läuft.", "num_beams": 2}).json()
    hits, jobs = lookups(cached, "translation")[0], cached.submitted.count
    oip = cached.post("/v2/models/translation/infer", json={
        "inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["Ein Hund läuft."]}],
        "parameters": {"num_beams": 2}}).json()
    assert lookups(cached, "translation")[0] == hits + 1 and cached.submitted.count == jobs
    assert oip["outputs"][0]["data"] == [native["translations"][0][0]["text"]]
    top = cached.post("/v1/classify", json={**CLASSIFY, "top_k": 1}).json()  # top_k is the API's own: a hit
    full = cached.post("/v1/classify", json=CLASSIFY).json()
    assert top["predictions"][0] == full["predictions"][0][:1]
    plain = cached.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"]
    echoed = cached.post("/v1/completions", json={**COMPLETION, "echo": True}).json()  # so is echo
    assert echoed["choices"][0]["text"] == COMPLETION["prompt"] + plain


def test_sampling_without_a_seed_is_never_cached(cached):
    for path, body in [("/v1/generate", {**SAMPLED, "seed": None}),
                       ("/v1/completions", {"model": "gpt", "prompt": "ROMEO:\n", "max_tokens": 4})]:
        before, jobs, skipped = lookups(cached, "gpt"), cached.submitted.count, uncacheable(cached, "gpt")
        for _ in range(2):
            assert cached.post(path, json=body).status_code == 200
        assert lookups(cached, "gpt") == before and cached.submitted.count == jobs + 2
        assert uncacheable(cached, "gpt") == skipped + 2


def _stream_text(response) -> str:
    assert response.status_code == 200, response.text
    events = [json.loads(line.removeprefix("data: ")) for line in response.text.splitlines()
              if line.startswith("data: {")]
    return "".join(event.get("token", "") for event in events)


def test_a_stream_replays_a_hit_and_stores_what_it_ran(cached):
    body = {**GREEDY, "prompt": "HAMLET:\n"}
    unstreamed = cached.post("/v1/generate", json=body).json()["text"]
    jobs, hits = cached.submitted.count, lookups(cached, "gpt")[0]
    assert _stream_text(cached.post("/v1/generate", json={**body, "stream": True})) == unstreamed
    assert cached.submitted.count == jobs and lookups(cached, "gpt")[0] == hits + 1
    streamed = _stream_text(cached.post("/v1/translate", json={"text": "Ein Kind.", "num_beams": 1, "stream": True}))
    hits = lookups(cached, "translation")[0]
    again = cached.post("/v1/translate", json={"text": "Ein Kind.", "num_beams": 1}).json()
    assert again["translations"][0][0]["text"] == streamed and lookups(cached, "translation")[0] == hits + 1


def test_the_config_routes_and_triton_statistics_say_so(cached):
    models = {m["id"]: m for m in cached.get("/v1/models").json()["data"]}
    assert models["gpt"]["response_cache"] == {"enabled": True, "enabled_by": "TSERVE_RESPONSE_CACHE",
                                               "store": "local"}
    assert cached.get("/v2/models/vit/config").json()["response_cache"] == {"enable": True}
    stats = cached.get("/v2/models/gpt/versions/1/stats").json()["model_stats"][0]["inference_stats"]
    hits, misses = lookups(cached, "gpt")
    assert (stats["cache_hit"]["count"], stats["cache_miss"]["count"]) == (hits, misses) and hits > 0
    assert stats["cache_hit"]["ns"] > 0
    assert cached.get("/health/ready").json() == {"status": "ready"}


def test_off_by_default_on_by_a_models_config_and_off_for_all_with_none(repository, serving, tmp_path):
    configured = copy_versions(repository, tmp_path, ["gpt", "vit"])
    config = json.loads((configured / "gpt" / "1" / "config.json").read_text())
    (configured / "gpt" / "1" / "config.json").write_text(json.dumps({**config, "response_cache": {"enable": True}}))
    for folder, knobs, on in [(repository, {}, {"gpt": False, "vit": False}),
                              (configured, {}, {"gpt": True, "vit": False}),
                              (configured, {"response_cache": "none"}, {"gpt": False, "vit": False})]:
        with serving(_settings(folder, models=["gpt", "vit"], **knobs)) as client:
            submitted = Submitted(client)
            for model, enabled in on.items():
                assert client.get(f"/v2/models/{model}/config").json()["response_cache"] == {"enable": enabled}
            state = {m["id"]: m["response_cache"] for m in client.get("/v1/models").json()["data"]}
            assert state["gpt"]["enabled_by"] == ("config.json" if on["gpt"] else None)
            for _ in range(2):
                assert client.post("/v1/generate", json=GREEDY).status_code == 200
            assert lookups(client, "gpt") == ((1, 1) if on["gpt"] else (0, 0))
            assert submitted.count == (1 if on["gpt"] else 2)


def test_grpc_unary_and_streamed_calls_share_the_cache(repository, server_factory):
    """A real server's gRPC port (tritonclient.grpc): a repeat of a unary call and the same request streamed
    (ModelStreamInfer) are hits with the same text; ModelConfig and ModelStatistics say so."""
    with server_factory("response cache grpc", repository=repository, grpc_port=free_port(), response_cache="gpt",
                        variant="stored", calibration_cache="") as server:
        client = tgrpc.InferenceServerClient(f"127.0.0.1:{server.knobs['TSERVE_GRPC_PORT']}")
        try:
            params = {"max_new_tokens": 6, "temperature": 0}
            texts = [client.infer("gpt", [grpc_text_input("PROMPT", ["ROMEO:\n"])], parameters=params)
                     .as_numpy("TEXT")[0] for _ in range(2)]
            responses: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: responses.put((result, error)))
            client.async_stream_infer("gpt", [grpc_text_input("PROMPT", ["ROMEO:\n"])], parameters=params)
            streamed, final = b"", False
            while not final:
                result, error = responses.get(timeout=STREAM_WAIT_S)
                assert error is None, error
                streamed += b"".join(result.as_numpy("TEXT").tolist())
                final = result.get_response().parameters["triton_final_response"].bool_param
            client.stop_stream()
            assert texts[0] == texts[1] == streamed
            assert client.get_model_config("gpt", as_json=True)["config"]["response_cache"] == {"enable": True}
            stats = client.get_inference_statistics("gpt", as_json=True)["model_stats"][0]["inference_stats"]
            assert (int(stats["cache_hit"]["count"]), int(stats["cache_miss"]["count"])) == (2, 1)
        finally:
            client.close()
