"""A model handed over as KServe hands it to a runtime (issue 58, deploy/kserve/): the storage initializer copies the
InferenceService's storageUri, one model's folder of the repository (<version>/config.json, the ONNX files,
tokenizer.json), to /mnt/models, and the runtime's args name the model after the InferenceService
(`python -m service --model_name={{.Name}} --model_dir=/mnt/models`; TSERVE_MODEL_NAME and TSERVE_REPOSITORY):

- in-process, a folder laid out as /mnt/models with two versions of the tiny GPT is served under the given name, its
  highest version active, on the native, OpenAI and Open Inference Protocol routes, and under no other name;
- a repository root (<name>/<version>/) where one model's folder belongs is served under no name, and readiness
  says what to point at instead;
- a real `python -m service` with the runtime's arguments (over a TSERVE_REPOSITORY they override) answers the KServe
  SDK's REST and gRPC clients (tests/support/kserve.py) with the translation the native route gives.
"""

from __future__ import annotations

import shutil

import httpx
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.client.processes import LOOPBACK, free_port
from service.settings import Settings
from tests.support.kserve import GRPC_SCHEME, kserve_infer
from tests.support.repository import SOURCE_VERSION
from tests.support.waiting import PATIENCE_S, poll

pytestmark = pytest.mark.slow

NAME = "shakespeare"  # an InferenceService's name, not the repository's (gpt)
VERSIONS = ("1", "2")  # the storage initializer's copy holds both; the highest is served
GERMAN = "Zwei Hunde spielen im Schnee."
GREEDY = {"max_new_tokens": 8, "temperature": 0}


def model_folder(tiny_repository, target, kind: str, versions=VERSIONS):
    """`target` laid out as KServe's /mnt/models for the tiny repository's `kind`: its version folders, no name."""
    for version in versions:
        shutil.copytree(tiny_repository / kind / SOURCE_VERSION, target / version)
    return target


@pytest.fixture(scope="module")
def client(tiny_repository, tmp_path_factory, serving):
    mnt_models = model_folder(tiny_repository, tmp_path_factory.mktemp("mnt") / "models", "gpt")
    with serving(Settings(repository=mnt_models, model_name=NAME)) as client:
        yield client


def test_the_folder_is_served_under_the_inference_services_name(client):
    assert client.get(f"/v2/models/{NAME}/ready").status_code == 200
    metadata = client.get(f"/v2/models/{NAME}").json()
    assert (metadata["name"], metadata["versions"]) == (NAME, [VERSIONS[-1]])  # the versions loaded
    (model,) = client.get("/v1/models").json()["data"]
    assert (model["id"], model["kind"], model["versions"]) == (NAME, "gpt", [int(v) for v in VERSIONS])
    assert model["active_version"] == int(VERSIONS[-1])
    index = client.post("/v2/repository/index").json()
    assert sorted((e["name"], e["version"], e["state"]) for e in index) == [
        (NAME, VERSIONS[0], "UNAVAILABLE"), (NAME, VERSIONS[1], "READY")]


def test_every_api_serves_it_by_that_name_and_no_other(client):
    native = client.post("/v1/generate", json={"model": NAME, "prompt": "ROMEO:\n", **GREEDY})
    assert native.status_code == 200 and native.json()["model"] == NAME, native.text
    text = native.json()["text"]
    oip = client.post(f"/v2/models/{NAME}/infer", json={"inputs": [
        {"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": ["ROMEO:\n"]}], "parameters": GREEDY})
    assert oip.status_code == 200 and oip.json()["outputs"][0]["data"] == [text], oip.text
    openai = client.post("/v1/completions", json={"model": NAME, "prompt": "ROMEO:\n", "max_tokens": 8,
                                                  "temperature": 0})
    assert openai.status_code == 200 and openai.json()["choices"][0]["text"] == text, openai.text
    assert client.get("/v2/models/gpt").status_code == 404
    unnamed = client.post("/v1/generate", json={"prompt": "x", **GREEDY})  # the kind's name, gpt: not served here
    assert unnamed.status_code == 404 and "'gpt' not found" in unnamed.text, unnamed.text


def test_a_repository_root_where_a_model_folder_belongs_says_where_to_point(tiny_repository, tmp_path):
    root = tmp_path / "models"
    model_folder(tiny_repository, root / "gpt", "gpt", versions=(SOURCE_VERSION,))
    with TestClient(create_app(Settings(repository=root, model_name=NAME))) as client:
        def not_ready_reasons():
            answer = client.get("/health/ready")
            return answer.status_code == 503 and not any("loading" in r for r in answer.json()["reasons"]) \
                and answer.json()["reasons"]

        (reason,) = poll(not_ready_reasons, PATIENCE_S, message="the loader to give up")
        assert f"no models found in {root}" in reason, reason
        assert "gpt: not a version" in reason and "this folder holds versions itself" in reason, reason
        assert client.get("/v1/models").json()["data"] == []


def test_the_runtimes_arguments_serve_the_kserve_sdks_rest_and_grpc_clients(tiny_repository, tmp_path,
                                                                           server_factory):
    mnt_models = model_folder(tiny_repository, tmp_path / "mnt" / "models", "translation", (SOURCE_VERSION,))
    grpc_port = free_port()
    args = [f"--model_name={NAME}", f"--model_dir={mnt_models}"]  # over the factory's TSERVE_REPOSITORY
    cases = [{"model": NAME, "id": "kserve-1", "parameters": {"num_beams": 2},
              "inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": [GERMAN]}]},
             {"model": "translation",
              "inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": [GERMAN]}]}]
    with server_factory("kserve model dir", args=args, grpc_port=grpc_port) as server:
        native = httpx.post(f"{server.url}/v1/translate", json={"model": NAME, "text": GERMAN, "num_beams": 2},
                            timeout=60)
        rest = kserve_infer(server.url, cases, tmp_path)
        grpc = kserve_infer(f"{GRPC_SCHEME}{LOOPBACK}:{grpc_port}", cases, tmp_path)
    assert native.status_code == 200, native.text
    expected = native.json()["translations"][0][0]["text"]
    for answers, not_found in ((rest, 404), (grpc, "NOT_FOUND")):
        translated, unknown = answers
        assert (translated["id"], translated["model_name"]) == ("kserve-1", NAME)
        assert translated["outputs"]["TRANSLATION"]["data"] == [expected]
        assert unknown["status"] == not_found and "translation" in unknown["error"]
