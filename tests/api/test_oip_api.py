"""The Open Inference Protocol (KServe v2 REST) proven with the real `tritonclient.http` against a real server on
the tiny models: health, server and model metadata, and inference for all three models with binary and JSON
tensors, requested outputs, the classification extension, `async_infer`, deadlines and errors. The ViT's
probabilities equal the native route's for the same images; greedy text equals the native routes' text.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from PIL import Image
from tritonclient.utils import InferenceServerException

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


def png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def text_input(name: str, texts: list[str], binary: bool = True) -> triton.InferInput:
    tensor = triton.InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object), binary_data=binary)
    return tensor


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
    files = [png(image) for image in images]
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
    encoded.set_data_from_numpy(np.array([png(image) for image in images], dtype=object))
    from_pixels = client.infer("vit", [pixels]).as_numpy("PROBABILITIES")
    from_files = client.infer("vit", [encoded]).as_numpy("PROBABILITIES")
    np.testing.assert_allclose(from_pixels, from_files, atol=1e-6)


def test_classification_extension_and_requested_outputs(client, images):
    tensor = triton.InferInput("IMAGE", [2], "BYTES")
    tensor.set_data_from_numpy(np.array([png(image) for image in images[:2]], dtype=object))
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
