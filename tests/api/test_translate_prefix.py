"""`target_prefix` (CTranslate2's option) on the released translator, through a real server: every translation starts
with the prefix (greedy, beams, streamed first), greedy continues with the most likely token given the source, the
prefix and the tokens so far (the engine stepped by hand), the score sums the generated tokens' log-probabilities
only (teacher-forced `score_ids`), the Open Inference Protocol takes it over REST and gRPC (unary and streamed),
bad prefixes are 400s (422s) naming the field, and on the in-place option of the same weights a request with a
prefix decodes bit for bit the same alone and among 15 others (docs/architecture.md, "Batch invariance")."""

from __future__ import annotations

import json
import queue
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException

from export.kv_inplace import add_step_graph
from service.client.processes import free_port
from service.client.sse import parse_sse
from service.decoding import BeamSearch, GreedySearch
from service.engines.translation import TranslationEngine
from service.repository import ModelRepository
from tests.support import ROOT
from tests.support.responses import error_of
from tests.support.triton_inputs import grpc_text_input

pytestmark = pytest.mark.slow

RELEASE = ModelRepository(ROOT / "model_repository").get("translation")
SERVED, IN_PLACE = RELEASE.version, RELEASE.version + 1  # the released graphs; its weights with the in-place step
PREFIX = "A guy"  # not how the translator starts these sentences by itself
GERMAN = ["Ein Mann fährt mit dem Fahrrad durch die Stadt.", "Zwei Hunde spielen im Schnee.",
          "Eine Frau in einem roten Kleid singt auf einer Bühne.", "Ein Mann steht auf einer Leiter."]
MAX_NEW = 30
TIE = 1e-4  # a token within this of the most likely logit counts as most likely (last-bit differences of graphs)
SCORE_TOLERANCE = 1e-4  # |served score - teacher-forced score| (one pass over every position vs one step each)
OTHERS = 15
STREAM_WAIT_S = 60.0


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    """The released translator as itself (SERVED) and with the in-place step graph (IN_PLACE)."""
    root = tmp_path_factory.mktemp("prefix-repository")
    for version in (SERVED, IN_PLACE):
        shutil.copytree(RELEASE.path, root / "translation" / str(version))
    folder = root / "translation" / str(IN_PLACE)
    config = json.loads((folder / "config.json").read_text())
    add_step_graph(folder, config)
    (folder / "config.json").write_text(json.dumps({**config, "version": IN_PLACE}))
    return root


@pytest.fixture(scope="module")
def server(server_factory, repository):
    with server_factory("target prefix", repository=repository, grpc_port=free_port(),
                        models=f"translation:{SERVED},translation:{IN_PLACE}") as process:
        yield process


@pytest.fixture(scope="module")
def rest(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_client(server):
    client = tgrpc.InferenceServerClient(f"127.0.0.1:{server.knobs['TSERVE_GRPC_PORT']}")
    yield client
    client.close()


@pytest.fixture(scope="module")
def engine(repository) -> TranslationEngine:
    return TranslationEngine(ModelRepository(repository).get("translation", SERVED))


def translate(rest, text, **fields) -> list:
    response = rest.post("/v1/translate", json={"text": text, "version": SERVED, **fields})
    assert response.status_code == 200, response.text
    return response.json()["translations"]


def test_greedy_continues_with_the_most_likely_token_after_the_prefix(rest, engine):
    forced = engine.tokenizer.encode(PREFIX).ids
    served = translate(rest, GERMAN, num_beams=1, max_new_tokens=MAX_NEW, target_prefix=PREFIX)
    sources = [engine.source_ids(text) for text in GERMAN]
    searches = engine.translate_ids(sources, lambda i: GreedySearch(MAX_NEW, engine.eos_id, prefix=[engine.bos_id],
                                                                     forced_prefix=forced))
    for source, (translation,), search in zip(sources, served, searches):
        (hypothesis,) = search.results()
        assert translation["text"].startswith(PREFIX + " ")
        assert translation["text"] == engine.tokenizer.decode(forced + hypothesis.tokens)
        # the engine stepped by hand through the start token, the prefix and the output: at every position after
        # the prefix the output's token (then EOS) is the most likely one
        chosen = hypothesis.tokens + ([engine.eos_id] if hypothesis.finish_reason == "eos" else [])
        logits, batch = engine.prefill([source])
        for position, token in enumerate(forced + chosen):
            if position >= len(forced):
                assert logits[0, token] >= logits[0].max() - TIE, (translation["text"], position)
            logits = engine.step(batch, np.array([token]))
        # the score: the generated tokens' log-probabilities (EOS included), not the prefix's
        teacher_forced = engine.score_ids([source], [forced + hypothesis.tokens], [0])[0]
        assert translation["score"] == pytest.approx(teacher_forced[len(forced):].sum(), abs=SCORE_TOLERANCE)
        assert translation["score"] > teacher_forced.sum() + 0.1  # the prefix is unlikely: scoring it would show


def test_beams_start_with_the_prefix_and_score_the_generated_part(rest, engine):
    forced = engine.tokenizer.encode(PREFIX).ids
    served = translate(rest, GERMAN[0], num_beams=4, num_return_sequences=3, max_new_tokens=MAX_NEW,
                       target_prefix=PREFIX)[0]
    source = engine.source_ids(GERMAN[0])
    (search,) = engine.translate_ids([source], lambda i: BeamSearch(
        4, MAX_NEW, engine.eos_id, length_penalty=engine.length_penalty, num_return_sequences=3,
        prefix=[engine.bos_id], forced_prefix=forced))
    for translation, hypothesis in zip(served, search.results(), strict=True):
        assert translation["text"] == engine.tokenizer.decode(forced + hypothesis.tokens)
        assert translation["text"].startswith(PREFIX + " ")
        teacher_forced = engine.score_ids([source], [forced + hypothesis.tokens], [0])[0][len(forced):]
        expected = teacher_forced.sum() / len(teacher_forced) ** engine.length_penalty  # EOS counted, prefix not
        assert translation["score"] == pytest.approx(expected, abs=SCORE_TOLERANCE)


def test_the_stream_starts_with_the_prefix(rest):
    whole = translate(rest, GERMAN[1], num_beams=1, target_prefix=PREFIX)[0][0]
    response = rest.post("/v1/translate", json={"text": GERMAN[1], "num_beams": 1, "target_prefix": PREFIX,
                                                "stream": True, "version": SERVED})
    assert response.status_code == 200, response.text
    events = parse_sse(response.text)
    assert events[0] == {"token": PREFIX, "index": 0}
    assert "".join(event["token"] for event in events) == whole["text"]
    assert events[-1]["score"] == pytest.approx(whole["score"], abs=1e-9)


def test_an_empty_prefix_is_none(rest):
    for num_beams in (1, 4):
        assert translate(rest, GERMAN[:2], num_beams=num_beams, target_prefix="") == \
            translate(rest, GERMAN[:2], num_beams=num_beams)


@pytest.mark.parametrize("num_beams", [1, 4])
def test_the_open_inference_protocol_takes_it_over_rest_and_grpc(rest, grpc_client, num_beams):
    parameters = {"num_beams": num_beams, "target_prefix": PREFIX}
    native = [n_best[0] for n_best in translate(rest, GERMAN, **parameters)]
    body = {"inputs": [{"name": "TEXT", "shape": [len(GERMAN)], "datatype": "BYTES", "data": GERMAN}],
            "parameters": parameters}
    response = rest.post(f"/v2/models/translation/versions/{SERVED}/infer", json=body)
    assert response.status_code == 200, response.text
    outputs = {output["name"]: output["data"] for output in response.json()["outputs"]}
    assert outputs["TRANSLATION"] == [t["text"] for t in native]
    np.testing.assert_allclose(outputs["SCORE"], [t["score"] for t in native], atol=1e-5)
    result = grpc_client.infer("translation", [grpc_text_input("TEXT", GERMAN)], model_version=str(SERVED),
                               parameters=parameters)
    assert [x.decode() for x in result.as_numpy("TRANSLATION")] == [t["text"] for t in native]


def test_a_grpc_stream_starts_with_the_prefix(rest, grpc_client):
    whole = translate(rest, GERMAN[2], num_beams=1, target_prefix=PREFIX)[0][0]
    responses: queue.Queue = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        grpc_client.async_stream_infer("translation", [grpc_text_input("TEXT", GERMAN[2:3])],
                                       model_version=str(SERVED), parameters={"num_beams": 1, "target_prefix": PREFIX})
        texts = []
        while True:
            result, error = responses.get(timeout=STREAM_WAIT_S)
            assert error is None, error
            texts.append(result.as_numpy("TRANSLATION")[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        grpc_client.stop_stream()
    assert texts[0].startswith(PREFIX) and "".join(texts) == whole["text"]


UNWRITABLE = "A 😀 guy"  # the vocabulary has no emoji
TOO_LONG = "a " * 300  # 300 tokens: more than the model writes after its start token (max_target_length 256)


@pytest.mark.parametrize("prefix, status, says", [
    (TOO_LONG, 400, "target_prefix has 300 tokens"),
    (UNWRITABLE, 400, "target_prefix reads back as"),
    ("x" * 2_001, 422, "target_prefix"),  # longer than TSERVE_MAX_TEXT_CHARS
    (5, 422, "target_prefix"),
])
def test_bad_prefixes_are_refused_naming_the_field(rest, grpc_client, prefix, status, says):
    for stream in (False, True):
        response = rest.post("/v1/translate", json={"text": GERMAN[0], "num_beams": 1, "target_prefix": prefix,
                                                    "stream": stream})
        assert says in error_of(response, status)["message"]
    body = {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": GERMAN[:1]}],
            "parameters": {"target_prefix": prefix}}
    response = rest.post("/v2/models/translation/infer", json=body)
    assert response.status_code == 400 and "target_prefix" in response.json()["error"], response.text
    with pytest.raises(InferenceServerException, match="target_prefix"):
        grpc_client.infer("translation", [grpc_text_input("TEXT", GERMAN[:1])], parameters={"target_prefix": prefix})


TARGETS = {"greedy": {"text": GERMAN[0], "num_beams": 1, "max_new_tokens": MAX_NEW, "target_prefix": PREFIX},
           "beam": {"text": GERMAN[0], "num_beams": 4, "max_new_tokens": MAX_NEW, "target_prefix": "A guy on a"}}


def _other(i: int) -> dict:
    """Request i of the 15 beside the target: other sources, modes, budgets and prefixes, so rows join and leave."""
    body = {"text": GERMAN[1 + i % 3], "num_beams": 1 + i % 4, "max_new_tokens": 6 + 3 * i, "version": IN_PLACE}
    return {**body, "target_prefix": ["", "Two", "A woman in"][i % 3]}


@pytest.mark.parametrize("mode", TARGETS)
def test_a_prefixed_request_decodes_the_same_alone_and_among_others(rest, mode):
    target = {**TARGETS[mode], "version": IN_PLACE}
    alone = rest.post("/v1/translate", json=target).json()["translations"]
    for position in (0, OTHERS, OTHERS // 2):
        bodies = [_other(i) for i in range(OTHERS)]
        bodies.insert(position, target)
        started = threading.Barrier(len(bodies))

        def post(body):
            started.wait()  # every request in flight at once
            return rest.post("/v1/translate", json=body)

        with ThreadPoolExecutor(len(bodies)) as pool:
            responses = list(pool.map(post, bodies))
        assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
        assert responses[position].json()["translations"] == alone, (mode, position)
