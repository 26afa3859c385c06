"""A model's life cycle against operator mistakes and hostile model-control requests, through the ASGI app:

- a version that is not a version number (`"²"`, `"①"`, `"03"`, ...) is a 400 naming it, and with model control off
  every load/unload is a 403 before anything of the request is read;
- a live repository with mistakes in it (a half-written `config.json`, folders `gpt/²`, `gpt/01` beside `gpt/1`, a
  model folder no request can name) is listed without them (`/v1/models`, requests naming an unknown model) and the
  repository index reports each as UNAVAILABLE with the reason, never a 500; loading such a version is a 400;
- a version whose warm-up shows it cannot serve (3 labels for 10 classes, `std: 0`, NaN normalisation) is refused
  with a 400 and the serving version stays active;
- with every version of a configured model unloaded, readiness is 503 naming it and its requests are 404 saying it
  has no loaded version (not "not configured").
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import time

import pytest
from PIL import Image

from service.settings import Settings

pytestmark = pytest.mark.slow

KINDS = ("gpt", "translation", "vit")
NOT_VERSIONS = ["²", "①", "٣", "03", "0", "-1", "1.0", " 1", "1\n", "", "1" * 10, "9" * 5000, 0, -3, 10**10, True,
                1.5, [1], {"v": 1}]


def png(size: int = 28) -> str:
    buffer = io.BytesIO()
    Image.new("L", (size, size), 128).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


CLASSIFY = {"images": [png()]}


@pytest.fixture(scope="module")
def repository(tiny_repository_copy):
    """A private copy of the tiny repository (version 1 of each model), for the tests to break."""
    return tiny_repository_copy("lifecycle-repository", KINDS)


@pytest.fixture(scope="module")
def client(repository, serving):
    with serving(Settings(repository=repository, model_control=True)) as client:
        yield client


@pytest.fixture(scope="module")
def control_off(repository, serving):
    with serving(Settings(repository=repository, models=["vit"])) as client:
        yield client


def error_message(response) -> str:
    error = response.json()["error"]
    return error if isinstance(error, str) else error["message"]


def index_of(client) -> dict[tuple[str, str], dict]:
    response = client.post("/v2/repository/index")
    assert response.status_code == 200, response.text
    return {(e["name"], e["version"]): e for e in response.json()}


# --- item 6: version numbers from the client ---------------------------------------------------------------------

@pytest.mark.parametrize("action", ["load", "unload"])
@pytest.mark.parametrize("version", NOT_VERSIONS, ids=lambda v: repr(v)[:12])
def test_a_version_that_is_not_a_number_is_400(client, action, version):
    response = client.post(f"/v2/repository/models/vit/{action}", json={"parameters": {"version": version}})
    assert response.status_code == 400, response.text
    assert "version" in error_message(response) and "not a version number" in error_message(response)


@pytest.mark.parametrize("action", ["load", "unload"])
@pytest.mark.parametrize("body", [json.dumps({"parameters": {"version": v}}) for v in NOT_VERSIONS[:6]]
                         + ["{not json", '{"parameters": 3}', '{"parameters": {"version": "1", "x": 1}}', ""])
def test_model_control_off_refuses_before_reading_the_request(control_off, action, body):
    response = control_off.post(f"/v2/repository/models/vit/{action}", content=body.encode())
    assert response.status_code == 403, response.text
    assert "TSERVE_MODEL_CONTROL" in error_message(response)
    assert control_off.post("/v1/classify", json=CLASSIFY).status_code == 200


# --- item 7 and 15: a live repository with operator mistakes ------------------------------------------------------

def _copy(repository, source: str, target: str) -> None:
    shutil.copytree(repository / source, repository / target)  # `target` relative, or absolute elsewhere


def _write(repository, target: str, content: bytes) -> None:
    (repository / target).parent.mkdir(parents=True, exist_ok=True)
    (repository / target).write_bytes(content)


# (what the operator did, the index entry it shows as, a word its reason holds)
MISTAKES = {
    "half-written config": (lambda r: (_copy(r, "vit/1", "broken/1"), _write(r, "broken/1/config.json",
                                                                              b'{"kind": "vit", "lab')),
                            ("broken", "1"), "JSON"),
    "config not UTF-8": (lambda r: (_copy(r, "vit/1", "broken/1"), _write(r, "broken/1/config.json", b"\xff\xfe{")),
                         ("broken", "1"), "JSON"),
    "config a list": (lambda r: (_copy(r, "vit/1", "broken/1"), _write(r, "broken/1/config.json", b"[1, 2]")),
                      ("broken", "1"), "kind"),
    "unknown kind": (lambda r: (_copy(r, "vit/1", "broken/1"), _write(r, "broken/1/config.json", b'{"kind": "x"}')),
                     ("broken", "1"), "kind"),
    "no config": (lambda r: (_copy(r, "vit/1", "broken/1"), (r / "broken/1/config.json").unlink()),
                  ("broken", "1"), "config.json"),
    "superscript version folder": (lambda r: _copy(r, "gpt/1", "gpt/²"), ("gpt", "²"), "not a version"),
    "leading-zero duplicate": (lambda r: _copy(r, "gpt/1", "gpt/01"), ("gpt", "01"), "not a version"),
    "word version folder": (lambda r: _copy(r, "gpt/1", "gpt/latest"), ("gpt", "latest"), "not a version"),
    "unnameable model": (lambda r: _copy(r, "vit", "vit:2"), ("vit:2", ""), "not a model name"),
    "non-ascii model": (lambda r: _copy(r, "vit", "vït"), ("vït", ""), "not a model name"),
}
ADDED = ("broken", "gpt/²", "gpt/01", "gpt/latest", "vit:2", "vït")


@pytest.fixture
def mistake(repository, request):
    make, entry, word = MISTAKES[request.param]
    make(repository)
    yield entry, word
    for path in ADDED:
        shutil.rmtree(repository / path, ignore_errors=True)


@pytest.mark.parametrize("mistake", list(MISTAKES), indirect=True)
def test_a_repository_with_a_mistake_lists_without_it_and_reports_it(client, mistake):
    (name, version), word = mistake
    models = client.get("/v1/models")
    assert models.status_code == 200, models.text
    listed = {m["id"]: m for m in models.json()["data"]}
    assert set(listed) == set(KINDS)
    assert all(m["versions"] == [1] for m in listed.values()), listed
    entry = index_of(client)[(name, version)]
    assert entry["state"] == "UNAVAILABLE" and word in entry["reason"], entry
    for response in (client.post("/v1/generate", json={"model": "nope", "prompt": "A"}),
                     client.get("/v2/models/nope"), client.post("/v2/models/nope/infer", json={"inputs": []})):
        assert response.status_code == 404, response.text
    assert client.post("/v1/generate", json={"prompt": "A", "max_new_tokens": 2}).status_code == 200


@pytest.mark.parametrize("mistake", ["half-written config", "config not UTF-8", "config a list", "unknown kind",
                                     "no config"], indirect=True)
@pytest.mark.parametrize("parameters", [{"version": "1"}, {}])
def test_loading_a_version_that_is_not_a_valid_model_is_400(client, mistake, parameters):
    (name, version), word = mistake
    response = client.post(f"/v2/repository/models/{name}/load", json={"parameters": parameters})
    assert response.status_code == 400, response.text
    assert word in error_message(response) and "failed to load" in error_message(response)


def test_a_version_that_does_not_exist_is_still_404(client):
    for name, parameters in (("vit", {"version": "7"}), ("nope", {})):
        response = client.post(f"/v2/repository/models/{name}/load", json={"parameters": parameters})
        assert response.status_code == 404, response.text


# --- item 8: warm-up refuses a version that would serve errors ----------------------------------------------------

def _vit_config(repository, change) -> None:
    path = repository / "vit" / "2" / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))  # NaN and Infinity written as JSON's extension, as Python reads them


BROKEN_VITS = {
    "3 labels for 10 classes": (lambda c: c.update(labels=c["labels"][:3]), "labels"),
    "11 labels for 10 classes": (lambda c: c.update(labels=c["labels"] + ["extra"]), "labels"),
    "labels not strings": (lambda c: c.update(labels=list(range(10))), "labels"),
    "std 0": (lambda c: c["image"].update(std=0), "std"),
    "std negative": (lambda c: c["image"].update(std=-0.3), "std"),
    "std NaN": (lambda c: c["image"].update(std=float("nan")), "std"),
    "mean infinite": (lambda c: c["image"].update(mean=float("inf")), "mean"),
}


@pytest.mark.parametrize("case", list(BROKEN_VITS))
def test_a_version_whose_warm_up_fails_is_refused_and_the_serving_one_stays(client, repository, case):
    change, word = BROKEN_VITS[case]
    _copy(repository, "vit/1", "vit/2")
    try:
        _vit_config(repository, change)
        response = client.post("/v2/repository/models/vit/load", json={"parameters": {"version": "2"}})
        assert response.status_code == 400, response.text
        assert word in error_message(response), error_message(response)
        classified = client.post("/v1/classify", json=CLASSIFY)
        assert classified.status_code == 200 and classified.json()["version"] == 1, classified.text
        entry = index_of(client)[("vit", "2")]  # a failed warm-up, or a config.json the repository skips: why
        assert entry["state"] == "UNAVAILABLE" and word in entry["reason"], entry
        assert client.get("/health/ready").status_code == 200
    finally:
        shutil.rmtree(repository / "vit" / "2")


# --- items 12 and 15: a configured model with no loaded version ---------------------------------------------------

VIT_REQUESTS = [  # (method, path, body, status, a word the answer holds)
    ("GET", "/health/ready", None, 503, "vit"),
    ("GET", "/v2/health/ready", None, 503, None),
    ("GET", "/v2/models/vit/ready", None, 404, "no loaded version"),
    ("GET", "/v2/models/vit", None, 404, "no loaded version"),
    ("POST", "/v1/classify", CLASSIFY, 404, "no loaded version"),
    ("POST", "/v2/models/vit/infer", {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1],
                                                  "data": [png()]}]}, 404, "no loaded version"),
]


@pytest.mark.parametrize("method, path, body, status, word", VIT_REQUESTS, ids=[r[1] for r in VIT_REQUESTS])
def test_a_configured_model_with_no_loaded_version(client, method, path, body, status, word):
    unloaded = client.post("/v2/repository/models/vit/unload", json={})
    assert unloaded.status_code == 200, unloaded.text
    try:
        response = client.request(method, path, json=body)
        assert response.status_code == status, response.text
        if word is not None:
            text = response.text
            assert word in text and "not configured" not in text, text
    finally:
        assert client.post("/v2/repository/models/vit/load", json={}).status_code == 200
    assert client.get("/health/ready").status_code == 200
    assert client.request(method, path, json=body).status_code == 200


@pytest.mark.parametrize("body", [{"model": "gpt", "prompt": "A"}, {"prompt": "A"}])
def test_a_model_not_in_tserve_models_is_404_saying_so(control_off, body):
    response = control_off.post("/v1/generate", json=body)
    assert response.status_code == 404, response.text
    assert "no loaded version" in error_message(response) and "TSERVE_MODELS" in error_message(response)


# warm-up failures (a config.json its schema refuses, std 0, is skipped: tests/unit/models/test_config_schema.py)
@pytest.mark.parametrize("case", ["3 labels for 10 classes", "11 labels for 10 classes"])
def test_a_version_that_fails_warm_up_at_start_is_not_ready_until_a_good_one_loads(tiny_repository, tmp_path, case):
    from fastapi.testclient import TestClient

    from service.app import create_app

    change, word = BROKEN_VITS[case]
    repository = tmp_path / "repository"
    _copy(tiny_repository, "vit/1", repository / "vit" / "2")  # version 2 broken, the only one at start
    _vit_config(repository, change)
    with TestClient(create_app(Settings(repository=repository, model_control=True))) as client:
        registry = client.app.state.registry
        deadline = time.monotonic() + 60
        while registry.pending and time.monotonic() < deadline:
            time.sleep(0.05)
        ready = client.get("/health/ready")
        assert ready.status_code == 503 and any("vit" in r and word in r for r in ready.json()["reasons"]), ready.text
        refused = client.post("/v1/classify", json=CLASSIFY)
        assert refused.status_code == 503 and word in error_message(refused), refused.text
        _copy(tiny_repository, "vit/1", repository / "vit" / "3")
        assert client.post("/v2/repository/models/vit/load", json={}).status_code == 200
        assert client.get("/health/ready").status_code == 200
        classified = client.post("/v1/classify", json=CLASSIFY)
        assert classified.status_code == 200 and classified.json()["version"] == 3, classified.text


# --- the held-out prober's findings ------------------------------------------------------------------------------

@pytest.mark.parametrize("penalty", [float("nan"), float("inf"), -float("inf"), 5.5, -50.0])
def test_a_translation_whose_default_length_penalty_no_request_may_ask_for_is_refused(client, repository, penalty):
    _copy(repository, "translation/1", "translation/2")
    try:
        path = repository / "translation" / "2" / "config.json"
        config = json.loads(path.read_text())
        config["generation"] = {"length_penalty": penalty}
        path.write_text(json.dumps(config))  # NaN and Infinity as JSON's extension, as Python writes them
        response = client.post("/v2/repository/models/translation/load", json={"parameters": {"version": "2"}})
        assert response.status_code == 400 and "length_penalty" in error_message(response), response.text
        translated = client.post("/v1/translate", json={"text": "Ein Hund.", "num_beams": 4})
        assert translated.status_code == 200 and translated.json()["version"] == 1, translated.text
        assert translated.json()["translations"][0], translated.text  # an n-best list with a translation in it
    finally:
        shutil.rmtree(repository / "translation" / "2")


@pytest.mark.parametrize("depth", [1_000, 5_000, 100_000])
def test_a_config_nested_too_deeply_is_skipped_and_reported(client, repository, depth):
    folder = repository / "gpt" / "7"
    folder.mkdir()
    try:
        (folder / "config.json").write_text("[" * depth)
        models = client.get("/v1/models")
        assert models.status_code == 200 and [m["id"] for m in models.json()["data"]].count("gpt") == 1
        entry = index_of(client)[("gpt", "7")]
        assert entry["state"] == "UNAVAILABLE" and "nested too deeply" in entry["reason"], entry
        response = client.post("/v2/repository/models/gpt/load", json={"parameters": {"version": "7"}})
        assert response.status_code == 400 and "nested too deeply" in error_message(response), response.text
        assert client.post("/v1/generate", json={"prompt": "A", "max_new_tokens": 2}).status_code == 200
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("route", ["load", "unload"])
@pytest.mark.parametrize("body", ["[" * 1_000 + "]" * 1_000,
                                  '{"parameters": {"x": ' + "[" * 5_000 + "]" * 5_000 + "}}"])
def test_a_model_control_body_nested_too_deeply_is_a_400(client, route, body):
    response = client.post(f"/v2/repository/models/gpt/{route}", content=body,
                           headers={"content-type": "application/json"})
    assert response.status_code == 400 and "nested too deeply" in error_message(response), response.text
