"""HTTP contract of `POST /v1/translate/score` (forced decoding, as CTranslate2's `score_batch`) through the ASGI
app on the tiny translator: scoring the greedy translation `/v1/translate` answers gives that translation's score,
the response's fields agree with each other, one source scores several targets as the same pairs would, and bad
input is a 422 or 400 naming the field."""

import numpy as np
import pytest

from models.data import load_multi30k
from service.decoding import GreedySearch
from service.settings import Settings
from tests.support.responses import error_of
from tests.support.waiting import PATIENCE_S

pytestmark = pytest.mark.slow

SCORE = "/v1/translate/score"
GREEDY_TOLERANCE = 1e-4  # |score of the greedy translation - greedy /v1/translate's score|
SENTENCES = 16  # Multi30k validation sentences of the fixtures
MAX_TEXTS, MAX_TEXT_CHARS = 16, 300


@pytest.fixture(scope="module")
def client(tiny_repository, serving):
    settings = Settings(repository=tiny_repository, max_text_chars=MAX_TEXT_CHARS, max_texts=MAX_TEXTS,
                        max_timeout_ms=60_000)
    with serving(settings) as client:
        yield client


@pytest.fixture(scope="module")
def engine(client):
    return client.app.state.registry.resolve("translation", None, None).engine


@pytest.fixture(scope="module")
def german(data_dir):
    return [de for de, _ in load_multi30k(data_dir, "val")[:SENTENCES]]


def score(client, source, target, **fields) -> dict:
    response = client.post(SCORE, json={"source": source, "target": target, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_scoring_the_greedy_translation_gives_its_score(client, engine, german):
    translations = client.post("/v1/translate", json={"text": german, "num_beams": 1}).json()["translations"]
    texts = [n_best[0]["text"] for n_best in translations]
    scores = score(client, german, texts)["scores"]
    sources = [engine.source_ids(text) for text in german]
    outputs = [s.results()[0] for s in engine.translate_ids(sources, lambda i: GreedySearch(
        engine.default_max_new_tokens(len(sources[i])), engine.eos_id, prefix=[engine.bos_id]))]
    compared = 0
    for text, (greedy,), scored, output in zip(texts, translations, scores, outputs):
        assert engine.tokenizer.decode(output.tokens) == text
        # the target's tokens are the greedy output's when the tokenizer reads that text back into them (a tiny
        # model may spell a word in pieces the tokenizer would not choose), and the score counts EOS when the
        # greedy search chose it
        if engine.tokenizer.encode(text).ids == output.tokens and output.finish_reason == "eos":
            assert abs(scored["score"] - greedy["score"]) < GREEDY_TOLERANCE, (text, scored, greedy)
            compared += 1
    assert compared >= SENTENCES // 4, compared


def test_the_response_fields_agree(client, engine, german):
    body = score(client, german[:2], ["A man is riding a bicycle.", "Two dogs play in the snow."])
    assert (body["model"], body["version"]) == ("translation", 1)
    for scored, text in zip(body["scores"], ["A man is riding a bicycle.", "Two dogs play in the snow."]):
        assert scored["token_ids"] == [*engine.tokenizer.encode(text).ids, engine.eos_id]
        assert scored["tokens"] == [engine.tokenizer.id_to_token(i) for i in scored["token_ids"]]
        assert scored["tokens"][-1] == "</s>"
        assert len(scored["logprobs"]) == len(scored["tokens"]) and all(lp <= 0 for lp in scored["logprobs"])
        assert scored["score"] == pytest.approx(sum(scored["logprobs"]), abs=1e-9)
        assert scored["mean_logprob"] == pytest.approx(scored["score"] / len(scored["tokens"]), abs=1e-9)
    sources = [engine.source_ids(text) for text in german[:2]]
    assert body["usage"] == {"prompt_tokens": sum(map(len, sources)),
                             "completion_tokens": sum(len(s["tokens"]) for s in body["scores"])}


def test_one_source_scores_every_target_as_pairs_would(client, engine, german):
    targets = ["A man is riding a bicycle.", "A man rides a bike.", "Two dogs play in the snow."]
    shared = score(client, german[0], targets)
    paired = score(client, [german[0]] * len(targets), targets)
    assert [s["tokens"] for s in shared["scores"]] == [s["tokens"] for s in paired["scores"]]
    np.testing.assert_allclose([s["score"] for s in shared["scores"]], [s["score"] for s in paired["scores"]],
                               atol=1e-5)
    assert shared["usage"]["prompt_tokens"] == len(engine.source_ids(german[0]))  # encoded once
    assert paired["usage"]["prompt_tokens"] == len(targets) * len(engine.source_ids(german[0]))
    single = score(client, german[0], targets[0])
    assert single["scores"][0]["score"] == pytest.approx(shared["scores"][0]["score"], abs=1e-5)


@pytest.mark.parametrize("payload, status, fragment", [
    ({"source": "Ein Hund."}, 422, "target: Field required"),
    ({"target": "A dog."}, 422, "source: Field required"),
    ({"source": "Ein Hund.", "target": "   "}, 422, "target"),
    ({"source": "Ein Hund.", "target": []}, 422, "target"),
    ({"source": "Ein Hund.", "target": ["A dog."] * (MAX_TEXTS + 1)}, 422, "target"),
    ({"source": "Ein Hund.", "target": "x" * (MAX_TEXT_CHARS + 1)}, 422, "target"),
    ({"source": ["Ein Hund."] * (MAX_TEXTS + 1), "target": ["A dog."] * (MAX_TEXTS + 1)}, 422, "source"),
    ({"source": "Ein Hund.", "target": "A dog.", "num_beams": 4}, 422, "num_beams"),
    ({"source": "Ein Hund.", "target": "A dog.", "timeout_ms": 120_000}, 422, "timeout_ms"),
    # what the schema cannot say: 400 naming the field
    ({"source": ["Ein Hund.", "Eine Katze."], "target": "A dog."}, 400, "target must be a list of 2"),
    ({"source": ["Ein Hund.", "Eine Katze."], "target": ["A dog."]}, 400, "1 targets for 2 sources"),
    ({"source": "Ein Hund.", "target": "a " * (MAX_TEXT_CHARS // 2)}, 400, "target 0 has"),
    # routing
    ({"source": "Ein Hund.", "target": "A dog.", "model": "gpt"}, 404, "gpt model"),
    ({"source": "Ein Hund.", "target": "A dog.", "version": 9}, 404, "no loaded version 9"),
])
def test_bad_input_names_the_field(client, payload, status, fragment):
    assert fragment in error_of(client.post(SCORE, json=payload), status)["message"]


def test_the_deadline_is_a_504(client):
    long_targets = [" ".join(["a man is riding a bicycle"] * 10)] * MAX_TEXTS  # 60 tokens each
    error_of(client.post(SCORE, json={"source": "Ein Mann.", "target": long_targets, "timeout_ms": 1}), 504)


def test_the_route_is_documented_with_examples_that_succeed(client):
    spec = client.get("/openapi.json").json()
    operation = spec["paths"][SCORE]["post"]
    assert {"200", "400", "404", "422", "504"} <= set(operation["responses"])
    schema = spec["components"]["schemas"][
        operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]]
    for name, field in schema["properties"].items():
        assert field.get("description") and field.get("examples"), name
    assert schema["properties"]["target"]["anyOf"][1]["maxItems"] == MAX_TEXTS
    for example in schema["examples"]:
        assert client.post(SCORE, json=example).status_code == 200


def test_requests_are_counted_under_their_endpoint_with_the_score_mode(client):
    score(client, "Ein Hund.", "A dog.")
    metrics = client.get("/metrics").text
    assert any(line.startswith("tserve_request_duration_seconds_count{") and 'endpoint="/v1/translate/score"' in line
               and 'mode="score"' in line and 'status="200"' in line and not line.endswith(" 0.0")
               for line in metrics.splitlines()), metrics[:2000]


def test_scoring_beyond_max_scoring_requests_is_a_429_until_a_slot_is_free(tiny_repository, serving, monkeypatch):
    """Backpressure: with one slot, a second request while the first is scoring is refused at once (429 with
    Retry-After), and the slot is free again when the first one's work has ended."""
    import threading

    with serving(Settings(repository=tiny_repository, max_scoring_requests=1)) as client:
        engine = client.app.state.registry.resolve("translation", None, None).engine
        entered, release = threading.Event(), threading.Event()
        real = engine.score_ids

        def held(*args, **kwargs):
            entered.set()
            assert release.wait(PATIENCE_S), "the test never released the scoring pass"
            return real(*args, **kwargs)

        monkeypatch.setattr(engine, "score_ids", held)
        body = {"source": "Ein Mann.", "target": "A man."}
        first = {}
        thread = threading.Thread(target=lambda: first.setdefault("response", client.post(SCORE, json=body)))
        thread.start()
        assert entered.wait(PATIENCE_S)
        refused = client.post(SCORE, json=body)
        assert "max_scoring_requests" in error_of(refused, 429)["message"]
        assert int(refused.headers["Retry-After"]) >= 1
        # issue 51 item 11: the schedulers' rule, both hints within the refused request's own deadline
        short = client.post(SCORE, json={**body, "timeout_ms": 400})
        assert "max_scoring_requests" in error_of(short, 429)["message"]
        assert short.headers["Retry-After"] == "1" and 1 <= int(short.headers["retry-after-ms"]) <= 400, short.headers
        release.set()
        thread.join(PATIENCE_S)
        assert first["response"].status_code == 200, first["response"].text
        monkeypatch.setattr(engine, "score_ids", real)
        assert client.post(SCORE, json=body).status_code == 200  # the slot was given back
