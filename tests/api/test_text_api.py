"""HTTP contract of /v1/translate, /v1/generate, /v1/models, health and metrics, through the ASGI app
(the real-process behaviours - streaming over a socket, disconnects, SIGTERM - are in test_server_process.py)."""

import json

import numpy as np
import pytest

from service.decoding import BeamSearch, GreedySearch
from service.settings import Settings
from tests.support.responses import error_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(tiny_repository, serving):
    settings = Settings(repository=tiny_repository, max_text_chars=300, max_new_tokens=60, max_timeout_ms=60_000)
    with serving(settings) as client:
        yield client


@pytest.fixture(scope="module")
def engines(client):
    registry = client.app.state.registry
    return registry.resolve("translation", None, None).engine, registry.resolve("gpt", None, None).engine


def post_json(client, path, payload):
    """POST `payload` as JSON with non-ASCII escaped, so that strings no UTF-8 can hold (lone surrogates) go out
    as the escapes a hostile client would send."""
    return client.post(path, content=json.dumps(payload), headers={"content-type": "application/json"})


# --- operations ---------------------------------------------------------------------------------------------

def test_health_and_models(client):
    assert client.get("/health/live").json() == {"status": "live"}
    assert client.get("/health/ready").json() == {"status": "ready"}
    listing = client.get("/v1/models").json()  # OpenAI's shape, with this service's details on each entry
    assert listing["object"] == "list"
    models = {m["id"]: m for m in listing["data"]}
    assert set(models) == {"translation", "gpt", "vit"}
    assert all(m["object"] == "model" and m["owned_by"] and m["created"] > 0 for m in models.values())
    for name, kind in [("translation", "translation"), ("gpt", "gpt"), ("vit", "vit")]:
        assert models[name]["kind"] == kind and models[name]["active_version"] == 1 and models[name]["ready"]
        assert models[name]["provider"] == "CPUExecutionProvider" and models[name]["versions"] == [1]
    # the tiny exports: what each config.json says, the stored weights (the suite's TSERVE_VARIANT), and the
    # variants each offers: its stored one, and the other if its export-time check passed on this CPU
    for name in models:
        variant = models[name]["variant"]
        config = json.loads((client.app.state.registry.repository.root / name / "1" / "config.json").read_text())
        assert variant.pop("offered_weights") == ",".join(["fp32", *config.get("variants", {})])
        assert variant.pop("reason") == "pinned by TSERVE_VARIANT (stored)"
        assert variant.pop("not_offered")["fp16"].startswith("ONNX Runtime's CPU provider")  # CUDA's variant
        plain = {"weights": "fp32", "stored_weights": "fp32", "chosen_by": "pinned", "attention": "plain"}
        # ViT: no KV cache; the text models' on the host under the CPU provider (TSERVE_KV_RESIDENCE=auto)
        # the GPT's prompt passes from its prefix cache (on by default), its steps not speculated (off by default)
        gpt = {"prefix_cache": "on", "speculation": "off", "prefix_caching": {
            "enabled": "true", "block_tokens": "16", "budget_bytes": str(256 << 20)}} if name == "gpt" else {}
        assert variant == (plain if name == "vit" else {**plain, "kv_cache": "concat", "kv_residence": "host", **gpt})


def test_request_id_is_accepted_and_echoed(client):
    response = client.get("/v1/models", headers={"X-Request-ID": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    generated = client.get("/v1/models").headers["x-request-id"]
    assert len(generated) == 32  # a fresh uuid4 hex when none (or an unsafe one) is given
    assert client.get("/v1/models", headers={"X-Request-ID": "bad id\twith spaces"}).headers["x-request-id"] != \
        "bad id\twith spaces"


def test_openapi_documents_every_endpoint_with_examples(client):
    spec = client.get("/openapi.json").json()
    assert {"/v1/translate", "/v1/generate", "/v1/models", "/health/live", "/health/ready", "/metrics"} <= \
        set(spec["paths"])
    schemas = spec["components"]["schemas"]

    def request_schema(path, content_type="application/json"):
        schema = spec["paths"][path]["post"]["requestBody"]["content"][content_type]["schema"]
        return schemas[schema["$ref"].rsplit("/", 1)[1]] if "$ref" in schema else schema

    for path in ("/v1/translate", "/v1/generate", "/v1/classify"):
        schema = request_schema(path)
        assert schema.get("examples"), path
        for field_name, field in schema["properties"].items():
            assert field.get("description") and field.get("examples"), f"{path}: {field_name}"
    assert "files" in request_schema("/v1/classify", "multipart/form-data")["properties"]
    assert "429" in spec["paths"]["/v1/generate"]["post"]["responses"]


def test_the_schemas_own_examples_succeed_and_state_the_settings_limits(client):
    """Every request example of the schema is answered 200, every field example is valid, and the limits that
    are settings are in the schema (this app: TSERVE_MAX_TEXT_CHARS=300, TSERVE_MAX_NEW_TOKENS=60)."""
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path in ("/v1/translate", "/v1/generate"):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        schema = schemas[ref.rsplit("/", 1)[1]]
        for example in schema["examples"]:
            assert client.post(path, json=example).status_code == 200, (path, example)
        for name, field in schema["properties"].items():
            if name not in ("model", "version", "stream"):  # each valid alone; model names differ per endpoint
                example = {**schema["examples"][0], name: field["examples"][0]}
                assert client.post(path, json=example).status_code == 200, (path, name, example)
    generate = schemas[spec["paths"]["/v1/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
                       ["$ref"].rsplit("/", 1)[1]]
    assert generate["properties"]["max_new_tokens"]["maximum"] == 60
    assert generate["properties"]["prompt"]["maxLength"] == 300
    assert spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"].keys() == {"text/plain"}


# --- translate ----------------------------------------------------------------------------------------------

def test_translate_matches_the_engine(client, engines):
    translation, _ = engines
    body = client.post("/v1/translate", json={"text": "Zwei Hunde spielen im Schnee."}).json()
    assert body["model"] == "translation" and body["version"] == 1
    source = translation.source_ids("Zwei Hunde spielen im Schnee.")
    max_new = translation.default_max_new_tokens(len(source))
    best = translation.translate_ids([source], lambda _: BeamSearch(
        4, max_new, translation.eos_id, length_penalty=translation.length_penalty, prefix=[translation.bos_id]
    ))[0].results()[0]
    assert body["translations"] == [[{"text": translation.tokenizer.decode(best.tokens), "score": best.score}]]


def test_the_default_length_penalty_is_the_models(client, engines, monkeypatch):
    translation, _ = engines
    assert translation.length_penalty == translation.model.config["generation"]["length_penalty"]

    def scores(**options):
        body = client.post("/v1/translate", json={"text": "Ein Mann fährt Fahrrad.", "num_beams": 4,
                                                  "num_return_sequences": 4, **options}).json()
        return [h["score"] for h in body["translations"][0]]

    monkeypatch.setattr(translation, "length_penalty", 2.0)
    assert scores() == scores(length_penalty=2.0) != scores(length_penalty=1.0)
    assert scores(length_penalty=None) == scores(length_penalty=2.0)  # an explicit null is the default too


def test_translate_batch_and_n_best(client, engines):
    texts = ["Ein Mann fährt Fahrrad.", "Eine Frau singt.", "Kinder spielen am Strand."]
    body = client.post("/v1/translate", json={"text": texts, "num_beams": 4, "num_return_sequences": 3}).json()
    assert len(body["translations"]) == 3
    for n_best in body["translations"]:
        scores = [h["score"] for h in n_best]
        assert len(n_best) == 3 and scores == sorted(scores, reverse=True)
    greedy = client.post("/v1/translate", json={"text": texts[0], "num_beams": 1}).json()
    translation, _ = engines
    source = translation.source_ids(texts[0])
    expected = translation.translate_ids([source], lambda _: GreedySearch(translation.default_max_new_tokens(
        len(source)), translation.eos_id))[0].results()[0]
    assert greedy["translations"][0][0]["text"] == translation.tokenizer.decode(expected.tokens)


@pytest.mark.parametrize("payload, status, fragment", [
    # the schema's limits (from the settings): 422 naming the field
    ({"text": ""}, 422, "text"),
    ({"text": ["ok", "   "]}, 422, "text.1: String should match pattern"),
    ({"text": ["Hallo."] * 33}, 422, "at most 32"),
    ({"text": "x" * 301}, 422, "at most 300 characters"),
    ({"text": "Ein \ud800 Mann", "num_beams": 1}, 422, "unicode"),
    ({"text": ["Ein Mann", "Ein \udfff"]}, 422, "unicode"),
    ({"text": "Hallo.", "colour": "blue"}, 422, "colour"),
    ({"text": "Hallo.", "num_beams": 0}, 422, "num_beams"),
    ({"text": "Hallo.", "num_beams": 9}, 422, "num_beams: Input should be less than or equal to 8"),
    ({"text": "Hallo.", "num_beams": "4"}, 422, "num_beams"),
    ({"text": "Hallo.", "stream": 0}, 422, "stream"),
    ({"text": "Hallo.", "early_stopping": "sometimes"}, 422, "early_stopping"),
    ({"text": "Hallo.", "max_new_tokens": 61}, 422, "max_new_tokens"),
    ({"text": "Hallo.", "timeout_ms": 120_000}, 422, "timeout_ms"),
    ({"text": "Hallo.", "model": ""}, 422, "model"),
    ({}, 422, "text"),
    # what the schema cannot say: 400 with the reason
    ({"text": "Hallo.", "num_beams": 2, "num_return_sequences": 3}, 400, "num_return_sequences"),
    ({"text": "Hallo.", "num_beams": 4, "stream": True}, 400, "stream"),
    ({"text": ["Hallo."], "num_beams": 1, "stream": True}, 400, "stream"),
    # routing
    ({"text": "Hallo.", "model": "nope"}, 404, "not found"),
    ({"text": "Hallo.", "version": 9}, 404, "no loaded version 9"),
    ({"text": "Hallo.", "model": "gpt"}, 404, "gpt model"),
])
def test_translate_bad_input(client, payload, status, fragment):
    assert fragment in error_of(post_json(client, "/v1/translate", payload), status)["message"]


def test_malformed_json_is_a_422(client):
    response = client.post("/v1/translate", content=b"{not json", headers={"content-type": "application/json"})
    assert error_of(response, 422)["type"] == "invalid_request"


# --- generate -----------------------------------------------------------------------------------------------

def test_greedy_generation_matches_the_engine(client, engines):
    _, gpt = engines
    body = client.post("/v1/generate", json={"prompt": "ROMEO:\n", "max_new_tokens": 30, "temperature": 0}).json()
    prompt = gpt.tokenizer.encode("ROMEO:\n").ids
    expected = gpt.generate([prompt], lambda _: GreedySearch(30, gpt.eos_id))[0].results()[0]
    assert body["text"] == gpt.tokenizer.decode(expected.tokens)
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 30}
    assert body["finish_reason"] == "length" and body["model"] == "gpt"


def test_sampling_is_reproducible_with_a_seed(client):
    payload = {"prompt": "To be", "max_new_tokens": 40, "temperature": 1.0, "top_k": 20, "top_p": 0.95, "seed": 11}
    first, second = (client.post("/v1/generate", json=payload).json()["text"] for _ in range(2))
    others = {client.post("/v1/generate", json={**payload, "seed": s}).json()["text"] for s in range(5)}
    assert first == second and len(others) > 1


def test_stop_strings_end_the_text(client):
    body = client.post("/v1/generate", json={"prompt": "ROMEO:\n", "max_new_tokens": 50, "temperature": 0,
                                              "stop": ["e"]}).json()
    assert body["finish_reason"] == "stop" and "e" not in body["text"]
    assert body["usage"]["completion_tokens"] >= len(body["text"])


def test_beam_search_generation(client, engines, tiny_runs):
    """`num_beams=3` answers the best beam of a width-3 beam search: the engine's own BeamSearch on the same prompt
    (no scheduler, no HTTP) gives the same text, finish reason and length, and so does the PyTorch checkpoint the
    graph was exported from, decoded by `models.generate` (an independent forward pass); its score is the best.
    The prompt is one for which, on the tiny model trained here, widths 1, 2 and 3 give three different best beams,
    so a search of the wrong width shows."""
    import torch

    from models.generate import generate_ids
    from models.runs import load_trained

    _, gpt = engines
    text = "KING RICHARD III:\n"
    body = client.post("/v1/generate", json={"prompt": text, "max_new_tokens": 12, "num_beams": 3})
    assert body.status_code == 200, body.text
    body = body.json()
    prompt = gpt.tokenizer.encode(text).ids

    def make(_):
        return BeamSearch(3, 12, gpt.eos_id, prefix=prompt, num_return_sequences=3)

    (engine_search,) = gpt.generate([prompt], make)
    _, model, *_ = load_trained(tiny_runs["gpt"])
    with torch.no_grad():
        (torch_search,) = generate_ids(model, [prompt], make)
    engine_beams, torch_beams = engine_search.results(), torch_search.results()
    assert [h.tokens for h in torch_beams] == [h.tokens for h in engine_beams]
    np.testing.assert_allclose([h.score for h in torch_beams], [h.score for h in engine_beams], atol=1e-4)
    best = engine_beams[0]
    assert best.score == max(h.score for h in engine_beams)
    assert body["text"] == gpt.tokenizer.decode(best.tokens) and body["finish_reason"] == best.finish_reason
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(best.tokens)}


def test_streamed_text_equals_the_plain_text(client):
    payload = {"prompt": "First Citizen:\n", "max_new_tokens": 40, "temperature": 0.8, "seed": 3, "stop": ["ou"]}
    plain = client.post("/v1/generate", json=payload).json()
    with client.stream("POST", "/v1/generate", json={**payload, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [e["index"] for e in events] == list(range(len(events)))
    assert "".join(e["token"] for e in events) == plain["text"]
    assert events[-1]["finish_reason"] == plain["finish_reason"] and events[-1]["usage"] == plain["usage"]


@pytest.mark.parametrize("payload, status, fragment", [
    ({"prompt": ""}, 422, "prompt"),
    ({"prompt": "x" * 301}, 422, "prompt"),
    ({"prompt": "O \ud800"}, 422, "unicode"),
    ({"prompt": "x" * 60, "max_new_tokens": 10}, 400, "context"),
    ({"prompt": "x", "max_new_tokens": 61}, 422, "max_new_tokens"),
    ({"prompt": "x", "max_new_tokens": 0}, 422, "max_new_tokens"),
    ({"prompt": "x", "temperature": -0.5}, 422, "temperature"),
    ({"prompt": "x", "top_p": 0}, 422, "top_p"),
    ({"prompt": "x", "top_k": -1}, 422, "top_k"),
    ({"prompt": "x", "stop": [""]}, 422, "stop"),
    ({"prompt": "x", "stop": ["\ud800"]}, 422, "stop"),
    ({"prompt": "x", "no_repeat_ngram_size": 11}, 422, "no_repeat_ngram_size"),
    ({"prompt": "x", "num_beams": 2, "stream": True}, 400, "stream"),
    ({"prompt": "x", "seed": "abc"}, 422, "seed"),
    ({"prompt": "x", "stream": "yes"}, 422, "stream"),
    ({"prompt": "x", "model": "vit"}, 404, "vit model"),
    ({"prompt": "x", "model": "\ud800"}, 422, "model"),
])
def test_generate_bad_input(client, payload, status, fragment):
    assert fragment in error_of(post_json(client, "/v1/generate", payload), status)["message"]


def test_min_new_tokens_above_max_new_tokens_is_a_400_naming_it(client):
    response = client.post("/v1/generate", json={"prompt": "x", "max_new_tokens": 5, "min_new_tokens": 6,
                                                  "temperature": 0})
    assert "min_new_tokens" in error_of(response, 400)["message"]


def test_unknown_route_and_method_are_json_errors(client):
    assert error_of(client.get("/v1/nothing"), 404)["type"] == "not_found"
    assert error_of(client.get("/v1/generate"), 405)["type"] == "method_not_allowed"


# --- metrics ------------------------------------------------------------------------------------------------

def test_generated_tokens_are_counted_exactly(client):
    def counted():
        return client.app.state.metrics.registry.get_sample_value(
            "tserve_generated_tokens_total", {"model": "gpt", "version": "1", "mode": "greedy"}) or 0.0

    before = counted()
    body = client.post("/v1/generate", json={"prompt": "ROMEO:", "max_new_tokens": 7, "temperature": 0}).json()
    assert body["usage"]["completion_tokens"] == 7 and counted() - before == 7


def test_metrics_describe_the_traffic(client):
    client.post("/v1/generate", json={"prompt": "ROMEO:", "max_new_tokens": 5, "temperature": 0})
    client.post("/v1/translate", json={"text": "Ein Hund."})
    client.post("/v1/translate", json={"text": ""})
    text = client.get("/metrics").text
    assert 'tserve_request_duration_seconds_count{api="native",endpoint="/v1/translate",mode="beam",' \
           'model="translation",status="200",version="1"}' in text
    for name in ("tserve_time_to_first_token_seconds_bucket", "tserve_inter_token_latency_seconds_bucket",
                 "tserve_queue_wait_seconds_bucket", "tserve_batch_size_bucket", "tserve_prompt_tokens_total",
                 'tserve_generated_tokens_total{mode="greedy",model="gpt",version="1"}', "tserve_queue_depth",
                 "tserve_running_requests", "tserve_model_load_seconds",
                 'tserve_model_info{attention="plain",chosen_by="pinned",kind="gpt",kv_cache="concat",'
                 'kv_residence="host",model="gpt",',
                 'tserve_model_info{attention="plain",chosen_by="pinned",kind="vit",model="vit",offered_weights=',
                 "tserve_ready 1.0"):
        assert name in text, name
    assert text.count('provider="CPUExecutionProvider",stored_weights="fp32",version="1",weights="fp32"} 1.0') == 2
    assert ('prefix_cache="on",provider="CPUExecutionProvider",speculation="off",stored_weights="fp32",version="1",'
            'weights="fp32"} 1.0') in text  # the GPT's
    assert 'tserve_request_failures_total{model="translation",reason="bad_input",version="1"}' in text


def test_each_native_request_maps_every_option_to_the_serving_parameters():
    """`to_params` is the one place a native request (and an inference request's options) becomes the serving
    call's parameters: every option given arrives there, under its own name."""
    from service.api.native.protocol import request_models

    models = request_models(Settings(max_new_tokens=60))
    translate = {"num_beams": 3, "length_penalty": 0.5, "early_stopping": "never", "num_return_sequences": 2,
                 "max_new_tokens": 7, "min_new_tokens": 1, "no_repeat_ngram_size": 2}
    params = models.translate.model_validate({"text": "Hallo.", **translate}).to_params()
    assert {name: getattr(params, name) for name in translate} == translate
    generate = {"max_new_tokens": 9, "min_new_tokens": 2, "temperature": 0.7, "top_k": 5, "top_p": 0.9,
                "repetition_penalty": 1.2, "no_repeat_ngram_size": 3, "seed": 11, "num_beams": 2}
    params = models.generate.model_validate({"prompt": "A", "stop": ["x", "yz"], **generate}).to_params()
    assert {name: getattr(params, name) for name in generate} == generate and params.stop == ("x", "yz")


@pytest.mark.parametrize("path, body", [
    ("/v1/translate", {"text": "Ein Hund.", "max_new_tokens": 3}),
    ("/v1/generate", {"prompt": "ROMEO:", "max_new_tokens": 3}),
    ("/v1/completions", {"model": "gpt", "prompt": "ROMEO:", "max_tokens": 3}),
    ("/v1/chat/completions", {"model": "gpt", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
])
def test_a_json_route_answers_a_form_or_text_body_with_415_naming_the_content_type(client, path, body):
    form = client.post(path, data={k: str(v) for k, v in body.items()})  # application/x-www-form-urlencoded
    assert form.status_code == 415, form.text
    assert "'application/x-www-form-urlencoded' is not supported here; send application/json" in form.text
    text = client.post(path, content=json.dumps(body), headers={"content-type": "text/plain"})
    assert text.status_code == 415 and "'text/plain'" in text.text
    bare = client.post(path, content=json.dumps(body))  # no Content-Type: FastAPI does not read it as JSON
    assert bare.status_code == 415 and "a body without a Content-Type is not supported here" in bare.text
    json_suffix = client.post(path, content=json.dumps(body), headers={"content-type": "application/vnd.x+json"})
    assert json_suffix.status_code == 200, json_suffix.text  # a JSON media type of another name is read as JSON
    # a JSON body that does not fit the schema is still the schema's error
    wrong = client.post(path, content=b"[]", headers={"content-type": "application/json"})
    assert wrong.status_code in (400, 422)


def test_the_probes_answer_head_as_they_answer_get(client):
    for path in ("/health/live", "/health/ready", "/metrics"):
        head, get = client.head(path), client.get(path)
        assert head.status_code == get.status_code == 200 and head.content == b""
        assert head.headers["content-type"] == get.headers["content-type"]
    assert client.head("/v1/translate").status_code == 405  # the other routes keep their methods
    assert not any("head" in operations for operations in client.get("/openapi.json").json()["paths"].values())
