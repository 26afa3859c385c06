"""The Open Inference Protocol (KServe v2 REST) proven with the real `tritonclient.http` against a real server on
the tiny models: health, server and model metadata, and inference for all three models with binary and JSON
tensors, requested outputs, the classification extension, `async_infer`, deadlines and errors. The ViT's
probabilities equal the native route's for the same images; greedy text equals the native routes' text.
Triton's model configuration and statistics extensions through `get_model_config` and `get_inference_statistics`
(the counts grow by exactly the requests made), and the real KServe SDK (`InferenceRESTClient`, in its own venv:
tests/api/kserve_sdk_client.py) for all three models, with the body fields it sends.
"""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.support.images import png_bytes
from tests.support.kserve import kserve_infer
from tests.support.triton_inputs import text_input

pytestmark = pytest.mark.slow

GERMAN = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee."]


@pytest.fixture(scope="module")
def server(server_factory):
    with server_factory("oip server", max_new_tokens=60) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    c = triton.InferenceServerClient(url=server.url.removeprefix("http://"), concurrency=4)
    yield c
    c.close()


@pytest.fixture(scope="module")
def images(data_dir) -> np.ndarray:
    from models.data import load_fashion_mnist

    return load_fashion_mnist(data_dir, "test")[0][:6]  # (6, 28, 28) uint8


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("vit") and client.is_model_ready("gpt", "1")
    assert not client.is_model_ready("nope")
    server = client.get_server_metadata()
    assert server["name"] == "transformer-serving" and "binary_tensor_data" in server["extensions"]
    vit = client.get_model_metadata("vit")
    assert vit["versions"] == ["1"]
    assert {(t["name"], t["datatype"]) for t in vit["inputs"]} == {("IMAGE", "BYTES"), ("PIXELS", "FP32")}
    assert {t["name"] for t in vit["outputs"]} == {"PROBABILITIES", "LABEL"}
    assert [t["name"] for t in client.get_model_metadata("gpt", "1")["inputs"]] == ["PROMPT"]


@pytest.mark.parametrize("binary", [True, False])
def test_vit_images_give_the_native_routes_probabilities(client, server, images, binary):
    files = [png_bytes(image) for image in images]
    data = np.array(files if binary else [base64.b64encode(f) for f in files], dtype=object)
    tensor = triton.InferInput("IMAGE", [len(files)], "BYTES")
    tensor.set_data_from_numpy(data, binary_data=binary)
    result = client.infer("vit", [tensor], outputs=[triton.InferRequestedOutput("PROBABILITIES", binary_data=binary),
                                                    triton.InferRequestedOutput("LABEL", binary_data=binary)])
    probabilities = result.as_numpy("PROBABILITIES")
    assert probabilities.shape == (len(files), 10) and probabilities.dtype == np.float32
    native = httpx.post(f"{server.url}/v1/classify", files=[("files", (f"{i}.png", f)) for i, f in enumerate(files)],
                        data={"top_k": "10"}).json()["predictions"]
    for row, predictions in zip(probabilities, native):
        for p in predictions:
            assert row[p["index"]] == pytest.approx(p["score"], abs=1e-6)
    labels = [x.decode() if isinstance(x, bytes) else x for x in result.as_numpy("LABEL")]
    assert labels == [predictions[0]["label"] for predictions in native]


def test_vit_pixels_equal_the_same_images_encoded(client, images):
    pixels = triton.InferInput("PIXELS", list(images.shape), "FP32")
    pixels.set_data_from_numpy(images.astype(np.float32) / 255.0)
    encoded = triton.InferInput("IMAGE", [len(images)], "BYTES")
    encoded.set_data_from_numpy(np.array([png_bytes(image) for image in images], dtype=object))
    from_pixels = client.infer("vit", [pixels]).as_numpy("PROBABILITIES")
    from_files = client.infer("vit", [encoded]).as_numpy("PROBABILITIES")
    np.testing.assert_allclose(from_pixels, from_files, atol=1e-6)


def test_classification_extension_and_requested_outputs(client, images):
    tensor = triton.InferInput("IMAGE", [2], "BYTES")
    tensor.set_data_from_numpy(np.array([png_bytes(image) for image in images[:2]], dtype=object))
    result = client.infer("vit", [tensor], outputs=[triton.InferRequestedOutput("PROBABILITIES", class_count=3)])
    top = result.as_numpy("PROBABILITIES")
    assert top.shape == (2, 3) and result.as_numpy("LABEL") is None  # only what was asked for
    score, index, label = top[0][0].decode().split(":")
    assert 0 < float(score) <= 1 and label and int(index) in range(10)


@pytest.mark.parametrize("binary", [True, False])
def test_translation_equals_the_native_route(client, server, binary):
    result = client.infer("translation", [text_input("TEXT", GERMAN, binary)], parameters={"num_beams": 4})
    native = httpx.post(f"{server.url}/v1/translate", json={"text": GERMAN, "num_beams": 4}).json()["translations"]
    assert [t.decode() for t in result.as_numpy("TRANSLATION")] == [n[0]["text"] for n in native]
    np.testing.assert_allclose(result.as_numpy("SCORE"), [n[0]["score"] for n in native], atol=1e-5)


def test_gpt_prompts_with_parameters_and_async_infer(client, server):
    prompts = ["ROMEO:\n", "KING:\n"]
    parameters = {"max_new_tokens": 20, "temperature": 0, "stop": "\n\n"}
    pending = client.async_infer("gpt", [text_input("PROMPT", prompts)], parameters=parameters,
                                 outputs=[triton.InferRequestedOutput("TEXT")])
    texts = [t.decode() for t in pending.get_result().as_numpy("TEXT")]
    for prompt, text in zip(prompts, texts):
        native = httpx.post(f"{server.url}/v1/generate", json={"prompt": prompt, **{**parameters, "stop": ["\n\n"]}})
        assert text == native.json()["text"]
    seeded = {"max_new_tokens": 10, "temperature": 0.9, "seed": 5}
    first, again = (client.infer("gpt", [text_input("PROMPT", prompts[:1])], parameters=seeded)
                    .as_numpy("TEXT")[0] for _ in range(2))
    assert first == again


def test_errors_come_as_the_protocol_says(client, server):
    with pytest.raises(InferenceServerException) as unknown:
        client.infer("nope", [text_input("PROMPT", ["x"])])
    assert unknown.value.status() == "404"
    with pytest.raises(InferenceServerException) as bad_input:
        client.infer("gpt", [text_input("WRONG", ["x"])])
    assert bad_input.value.status() == "400" and "PROMPT" in bad_input.value.message()
    with pytest.raises(InferenceServerException) as bad_option:
        client.infer("gpt", [text_input("PROMPT", ["x"])], parameters={"max_new_tokens": 10_000})
    assert bad_option.value.status() == "400" and "max_new_tokens" in bad_option.value.message()
    with pytest.raises(InferenceServerException) as late:
        client.infer("translation", [text_input("TEXT", GERMAN * 16)], parameters={"num_beams": 8}, timeout=1_000)
    assert late.value.status() == "504"
    response = httpx.post(f"{server.url}/v2/models/gpt/infer", content=b"{not json")
    assert response.status_code == 400 and set(response.json()) == {"error"}
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'api="oip",endpoint="/v2/models/{model}/infer"' in metrics


# --- body fields the SDKs send ------------------------------------------------------------------------------------


def test_the_body_may_name_its_model_and_id_and_the_response_echoes_the_id(client, server):
    result = client.infer("gpt", [text_input("PROMPT", ["ROMEO:\n"])], request_id="req-7",
                          parameters={"max_new_tokens": 4, "temperature": 0})
    assert result.get_response()["id"] == "req-7"
    body = {"id": "42", "model_name": "gpt", "model_version": "1", "parameters": None, "outputs": None,
            "inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": ["KING:\n"], "parameters": None}]}
    defaults = {"max_new_tokens": 3, "priority": 0, "sequence_id": 0, "sequence_start": False, "sequence_end": False}
    answer = httpx.post(f"{server.url}/v2/models/gpt/infer", json={**body, "parameters": defaults})
    assert answer.status_code == 200, answer.text
    assert answer.json()["id"] == "42" and answer.json()["model_name"] == "gpt"
    for field, value, named in [("model_name", "translation", "model_name"), ("model_version", "2", "model_version"),
                                ("sequence", 1, "sequence")]:
        refused = httpx.post(f"{server.url}/v2/models/gpt/infer", json={**body, field: value})
        assert refused.status_code == 400 and named in refused.json()["error"], (field, refused.text)


@pytest.mark.parametrize(("arguments", "named"), [({"sequence_id": 5}, "sequence_id"),
                                                  ({"sequence_id": 5, "sequence_start": True}, "sequence_start"),
                                                  ({"sequence_id": 5, "sequence_end": True}, "sequence_end")])
def test_protocol_parameters_the_server_does_not_implement_are_refused(client, arguments, named):
    """tritonclient's own arguments for them (it sends each only when it is not the default)."""
    with pytest.raises(InferenceServerException) as refused:
        client.infer("gpt", [text_input("PROMPT", ["x"])], parameters={"max_new_tokens": 2}, **arguments)
    assert refused.value.status() == "400" and named in refused.value.message()


def test_shared_memory_parameters_are_refused(server):
    body = {"inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": ["x"]}],
            "outputs": [{"name": "TEXT", "parameters": {"shared_memory_region": "out0"}}]}
    refused = httpx.post(f"{server.url}/v2/models/gpt/infer", json=body)
    assert refused.status_code == 400 and "shared_memory_region" in refused.json()["error"]


# --- Triton's model configuration and statistics extensions --------------------------------------------------------


def test_model_configuration_as_triton_writes_it(client, server):
    vit = client.get_model_config("vit")
    assert (vit["name"], vit["platform"], vit["backend"], vit["max_batch_size"]) == \
        ("vit", "onnxruntime_onnx", "onnxruntime", 0)
    assert [(t["name"], t["data_type"], t["dims"]) for t in vit["input"]] == \
        [("IMAGE", "TYPE_STRING", [-1]), ("PIXELS", "TYPE_FP32", [-1, 28, 28])]
    assert [(t["name"], t["data_type"], t["dims"]) for t in vit["output"]] == \
        [("PROBABILITIES", "TYPE_FP32", [-1, 10]), ("LABEL", "TYPE_STRING", [-1])]
    assert vit["version_policy"] == {"specific": {"versions": [1]}} and vit["instance_group"][0]["kind"] == "KIND_CPU"
    gpt = client.get_model_config("gpt", "1")
    assert [t["name"] for t in gpt["input"]] == ["PROMPT"] and gpt["parameters"]["kind"] == {"string_value": "gpt"}
    assert client.get_server_metadata()["extensions"][-2:] == ["model_configuration", "statistics"]
    with pytest.raises(InferenceServerException) as unknown:
        client.get_model_config("nope")
    assert unknown.value.status() == "404"
    missing = httpx.get(f"{server.url}/v2/models/gpt/versions/9/config")
    assert missing.status_code == 404 and set(missing.json()) == {"error"}


def _stats(client, model: str) -> dict:
    (stats,) = client.get_inference_statistics(model)["model_stats"]
    return stats


def _grew(before: dict, after: dict, *path: str) -> int:
    for key in path:
        before, after = before[key], after[key]
    return after - before


def test_statistics_count_exactly_the_requests_made(client, images):
    before = _stats(client, "vit")
    for image in images[:3]:
        tensor = triton.InferInput("IMAGE", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([png_bytes(image)], dtype=object))
        client.infer("vit", [tensor])
    after = _stats(client, "vit")
    assert (after["name"], after["version"]) == ("vit", "1")
    assert _grew(before, after, "inference_stats", "success", "count") == 3
    assert _grew(before, after, "inference_stats", "success", "ns") > 0
    assert _grew(before, after, "inference_stats", "fail", "count") == 0
    assert _grew(before, after, "inference_stats", "queue", "count") == 3
    assert _grew(before, after, "inference_count") == 3 and _grew(before, after, "execution_count") == 3
    ones = [{b["batch_size"]: b["compute_infer"]["count"] for b in s["batch_stats"]}.get(1, 0) for s in (before, after)]
    assert ones[1] - ones[0] == 3  # three batches of one image
    gpt_before = _stats(client, "gpt")
    for prompt in ("ROMEO:\n", "KING:\n"):
        client.infer("gpt", [text_input("PROMPT", [prompt])], parameters={"max_new_tokens": 5, "temperature": 0})
    gpt_after = _stats(client, "gpt")
    assert _grew(gpt_before, gpt_after, "inference_stats", "success", "count") == 2
    assert _grew(gpt_before, gpt_after, "inference_count") == 2  # two sequences
    assert _grew(gpt_before, gpt_after, "execution_count") >= 2  # decoding steps
    assert _grew(gpt_before, gpt_after, "inference_stats", "queue", "count") == 2


def test_statistics_count_failures_and_list_every_version(client, server):
    before = _stats(client, "translation")
    with pytest.raises(InferenceServerException):
        client.infer("translation", [text_input("TEXT", GERMAN * 16)], parameters={"num_beams": 8}, timeout=1_000)
    after = _stats(client, "translation")
    assert _grew(before, after, "inference_stats", "fail", "count") == 1
    assert _grew(before, after, "inference_stats", "fail", "ns") > 0
    assert _grew(before, after, "inference_stats", "success", "count") == 0
    every = client.get_inference_statistics()["model_stats"]
    assert [(s["name"], s["version"]) for s in every] == [("gpt", "1"), ("translation", "1"), ("vit", "1")]
    assert client.get_inference_statistics("vit", "1")["model_stats"][0]["version"] == "1"
    for path in ("/v2/models/nope/stats", "/v2/models/vit/versions/9/stats"):
        unknown = httpx.get(f"{server.url}{path}")
        assert unknown.status_code == 404 and set(unknown.json()) == {"error"}, path


# --- the KServe SDK -------------------------------------------------------------------------------------------------


def test_the_kserve_sdk_infers_with_every_model(server, images, tmp_path):
    prompts, greedy = ["ROMEO:\n", "KING:\n"], {"max_new_tokens": 12, "temperature": 0}
    pixels = (images[:2].astype(np.float32) / 255.0)
    files = [base64.b64encode(png_bytes(image)).decode() for image in images[:2]]
    cases = [
        {"model": "gpt", "id": "kserve-1", "parameters": greedy,
         "inputs": [{"name": "PROMPT", "shape": [2], "datatype": "BYTES", "data": prompts}]},
        {"model": "gpt", "parameters": greedy, "outputs": [{"name": "TEXT", "binary": True}],
         "inputs": [{"name": "PROMPT", "shape": [2], "datatype": "BYTES", "binary": True,
                     "data": [base64.b64encode(p.encode()).decode() for p in prompts]}]},
        {"model": "translation", "parameters": {"num_beams": 4},
         "inputs": [{"name": "TEXT", "shape": [2], "datatype": "BYTES", "data": GERMAN}]},
        {"model": "vit", "inputs": [{"name": "PIXELS", "shape": [2, 28, 28], "datatype": "FP32",
                                     "data": pixels.tolist()}]},
        {"model": "vit", "outputs": [{"name": "PROBABILITIES", "binary": True}, {"name": "LABEL"}],
         "inputs": [{"name": "IMAGE", "shape": [2], "datatype": "BYTES", "binary": True, "data": files}]},
        {"model": "translation", "url_model": "gpt",
         "inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": ["x"]}]},
        {"model": "gpt", "parameters": {"sequence_id": 3},
         "inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": ["x"]}]},
    ]
    text_json, text_binary, translated, from_pixels, from_files, wrong_model, sequence = \
        kserve_infer(server.url, cases, tmp_path)  # the SDK's InferenceRESTClient
    native = [httpx.post(f"{server.url}/v1/generate", json={"prompt": p, **greedy}).json()["text"] for p in prompts]
    assert text_json["id"] == "kserve-1" and text_json["model_name"] == "gpt"
    assert text_json["outputs"]["TEXT"]["data"] == native and text_binary["outputs"]["TEXT"]["data"] == native
    assert text_binary["id"]  # the SDK sends a uuid of its own when none is given; it comes back
    assert set(text_binary["outputs"]) == {"TEXT"}  # only what was asked for
    translations = httpx.post(f"{server.url}/v1/translate", json={"text": GERMAN, "num_beams": 4}).json()
    assert translated["outputs"]["TRANSLATION"]["data"] == [t[0]["text"] for t in translations["translations"]]
    assert from_pixels["outputs"]["PROBABILITIES"]["shape"] == [2, 10]
    np.testing.assert_allclose(from_pixels["outputs"]["PROBABILITIES"]["data"],
                               from_files["outputs"]["PROBABILITIES"]["data"], atol=1e-6)
    labels = [p[0]["label"] for p in httpx.post(f"{server.url}/v1/classify", files=[
        ("files", (f"{i}.png", base64.b64decode(f))) for i, f in enumerate(files)]).json()["predictions"]]
    assert from_files["outputs"]["LABEL"]["data"] == labels
    assert wrong_model["status"] == 400 and "model_name" in wrong_model["error"]
    assert sequence["status"] == 400 and "sequence_id" in sequence["error"]
