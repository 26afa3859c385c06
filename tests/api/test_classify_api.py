"""HTTP contract of POST /v1/classify through the ASGI app: multipart and base64-JSON bodies give the same
predictions as the engine, any image size or mode is accepted, and every bad input is a JSON 4xx (never a 500)."""

import base64
import io
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from models.data import load_fashion_mnist
from service.settings import Settings
from tests.support.images import png_header_claiming
from tests.support.metrics import metric, scrape
from tests.support.responses import error_of
from tests.support.waiting import poll

pytestmark = pytest.mark.slow

MAX_IMAGES, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS = 8, 200_000, 1_000_000
WAIT_S = 30.0  # the longest a step of the batching test may take on a busy machine


@pytest.fixture(scope="module")
def client(tiny_repository, serving):
    settings = Settings(repository=tiny_repository, models=["vit"], max_images=MAX_IMAGES,
                        max_image_bytes=MAX_IMAGE_BYTES, max_image_pixels=MAX_IMAGE_PIXELS, max_timeout_ms=60_000)
    with serving(settings) as client:
        yield client


@pytest.fixture(scope="module")
def engine(client):
    return client.app.state.registry.resolve("vit", None, None).engine


@pytest.fixture(scope="module")
def fashion(data_dir) -> list[Image.Image]:
    pixels, _ = load_fashion_mnist(data_dir, "test")
    return [Image.fromarray(image, mode="L") for image in pixels[:6]]


def encode(image: Image.Image, format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def multipart(*images: bytes, names=None, **fields):
    names = names or [f"image{i}.png" for i in range(len(images))]
    files = [("files", (name, data, "image/png")) for name, data in zip(names, images)]
    return {"files": files, "data": {k: str(v) for k, v in fields.items()}}


def check_predictions(predictions, engine, images, top_k):
    """One list per image, top_k long, best first, probabilities as the engine computes them."""
    expected = engine.classify(images, top_k=top_k)
    assert len(predictions) == len(images)
    for got, want in zip(predictions, expected):
        assert len(got) == top_k
        scores = [p["score"] for p in got]
        assert scores == sorted(scores, reverse=True) and 0 < sum(scores) <= 1 + 1e-6
        assert got[0]["label"] == want[0][0] and got[0]["index"] == want[0][1]
        assert all(engine.labels[p["index"]] == p["label"] for p in got)
        np.testing.assert_allclose(scores, [w[2] for w in want], atol=1e-4)


# --- predictions --------------------------------------------------------------------------------------------

def test_multipart_png_files(client, engine, fashion):
    response = client.post("/v1/classify", **multipart(*[encode(image) for image in fashion], top_k=3))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == "vit" and body["version"] == 1
    check_predictions(body["predictions"], engine, fashion, top_k=3)


def test_base64_json_gives_the_identical_response(client, fashion):
    files = [encode(image) for image in fashion]
    as_form = client.post("/v1/classify", **multipart(*files, top_k=4))
    as_json = client.post("/v1/classify", json={"images": [b64(f) for f in files], "top_k": 4})
    assert as_json.status_code == 200, as_json.text
    assert as_json.json() == as_form.json()


def test_defaults_and_routing_fields(client, engine, fashion):
    body = client.post("/v1/classify", json={"images": [b64(encode(fashion[0]))]}).json()
    assert len(body["predictions"][0]) == 5  # the default top_k
    routed = client.post("/v1/classify", **multipart(encode(fashion[0]), model="vit", version=1, timeout_ms=30_000,
                                                        top_k=5))
    assert routed.status_code == 200 and routed.json() == body
    all_labels = client.post("/v1/classify", json={"images": [b64(encode(fashion[0]))], "top_k": len(engine.labels)})
    assert sum(p["score"] for p in all_labels.json()["predictions"][0]) == pytest.approx(1.0, abs=1e-5)


def test_rgb_jpeg_of_another_size_and_rgba_png(client, engine, fashion):
    jpeg = fashion[1].resize((83, 61)).convert("RGB")
    rgba = fashion[2].resize((40, 40)).convert("RGBA")
    rgba.putalpha(Image.fromarray(np.where(np.asarray(fashion[2].resize((40, 40))) > 20, 255, 0).astype(np.uint8)))
    palette = fashion[3].convert("P")
    files = [encode(jpeg, "JPEG"), encode(rgba), encode(palette, "GIF")]
    response = client.post("/v1/classify", **multipart(*files, names=["a.jpg", "b.png", "c.gif"], top_k=2))
    assert response.status_code == 200, response.text
    decoded = [Image.open(io.BytesIO(f)) for f in files]  # what the server sees (JPEG is lossy)
    check_predictions(response.json()["predictions"], engine, decoded, top_k=2)


def test_data_urls_and_wrapped_base64_are_accepted(client, fashion):
    data = encode(fashion[0])
    plain = client.post("/v1/classify", json={"images": [b64(data)]}).json()
    wrapped = base64.encodebytes(data).decode()  # newline every 76 characters
    for text in (f"data:image/png;base64,{b64(data)}", wrapped):
        assert client.post("/v1/classify", json={"images": [text]}).json() == plain


def test_concurrent_requests_are_batched_without_changing_results(client, engine, fashion, monkeypatch):
    """Six one-image requests sent at once while the engine is held on the first: the other five wait in the queue
    (its depth gauge says so), and once the engine is let go they run as ONE batch, which the batch-size histogram
    records (a batch of 5 images); each answer equals the one that request got alone, and every response is a
    200, the reference ones included."""
    files = [encode(image) for image in fashion]
    alone = []
    for f in files:
        response = client.post("/v1/classify", json={"images": [b64(f)]})
        assert response.status_code == 200, response.text
        alone.append(response.json())
    held, entered = threading.Event(), threading.Event()
    logits = engine.logits

    def held_logits(batch):
        entered.set()
        assert held.wait(timeout=WAIT_S), "the test never let the engine go"
        return logits(batch)

    monkeypatch.setattr(engine, "logits", held_logits)
    before = scrape(client)
    with ThreadPoolExecutor(len(files)) as pool:
        first = pool.submit(client.post, "/v1/classify", json={"images": [b64(files[0])]})
        assert entered.wait(timeout=WAIT_S)  # the first request's batch is in the engine
        rest = [pool.submit(client.post, "/v1/classify", json={"images": [b64(f)]}) for f in files[1:]]
        poll(lambda: metric(scrape(client), "tserve_queue_depth", model="vit") == len(rest), timeout=WAIT_S,
             message=f"{len(rest)} requests waiting in the queue")
        held.set()
        together = [first.result(), *(future.result() for future in rest)]
    after = scrape(client)
    for response, single in zip(together, alone):
        assert response.status_code == 200, response.text
        got, want = response.json()["predictions"][0], single["predictions"][0]
        assert [p["index"] for p in got] == [p["index"] for p in want]
        np.testing.assert_allclose([p["score"] for p in got], [p["score"] for p in want], atol=1e-5)

    def grew(name: str, **labels) -> float:
        return metric(after, name, model="vit", **labels) - metric(before, name, model="vit", **labels)

    # two batches: the held one (1 image) and the five that waited, together (5 images: the (4, 8] bucket)
    assert grew("tserve_batch_size_count") == 2 and grew("tserve_batch_size_sum") == len(files)
    assert grew("tserve_batch_size_bucket", le="1.0") == 1
    assert grew("tserve_batch_size_bucket", le="4.0") == 1 and grew("tserve_batch_size_bucket", le="8.0") == 2


# --- bad input ----------------------------------------------------------------------------------------------


def test_unsupported_content_types_are_415(client):
    for headers, content in [({"content-type": "text/plain"}, b"hello"), ({}, b""),
                             ({"content-type": "image/png"}, b"\x89PNG")]:
        error = error_of(client.post("/v1/classify", content=content, headers=headers), 415)
        assert "multipart/form-data" in error["message"] and "application/json" in error["message"]


def test_too_many_images_is_a_422_as_the_schema_says(client, fashion):
    data = encode(fashion[0])
    for request in ({"json": {"images": [b64(data)] * (MAX_IMAGES + 1)}}, multipart(*[data] * (MAX_IMAGES + 1)),
                    multipart(*[data] * (MAX_IMAGES + 5))):
        assert f"at most {MAX_IMAGES}" in error_of(client.post("/v1/classify", **request), 422)["message"]
    assert client.post("/v1/classify", json={"images": [b64(data)] * MAX_IMAGES}).status_code == 200


def test_too_large_images_are_413(client):
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (300, 300, 3), dtype=np.uint8))
    big_file = encode(noise)  # ~270 KB of incompressible pixels, under the pixel limit
    assert len(big_file) > MAX_IMAGE_BYTES
    error = error_of(client.post("/v1/classify", **multipart(big_file, names=["noise.png"])), 413)
    assert "noise.png" in error["message"]
    assert "images.0" in error_of(client.post("/v1/classify", json={"images": [b64(big_file)]}), 422)["message"]
    many_pixels = encode(Image.new("L", (1200, 1000)))  # small file, 1.2 M pixels
    assert len(many_pixels) < MAX_IMAGE_BYTES
    assert "pixels" in error_of(client.post("/v1/classify", **multipart(many_pixels)), 413)["message"]
    for width, height in [(2_000, 2_000), (100_000, 100_000)]:  # refused from the header: no pixel is decoded
        bomb = png_header_claiming(width, height)  # (decoding would fail: a 400, not a 413)
        assert "pixels" in error_of(client.post("/v1/classify", json={"images": [b64(bomb)]}), 413)["message"]


def test_undecodable_images_are_400_naming_the_image(client, fashion):
    good = encode(fashion[0])
    error = error_of(client.post("/v1/classify", **multipart(good, b"not an image", names=["ok.png", "junk.png"])), 400)
    assert "files[1]" in error["message"] and "junk.png" in error["message"]
    truncated = good[: len(good) // 2]
    assert "files[0]" in error_of(client.post("/v1/classify", **multipart(truncated)), 400)["message"]
    assert "files[0]" in error_of(client.post("/v1/classify", **multipart(b"")), 400)["message"]
    error = error_of(client.post("/v1/classify", json={"images": [b64(good), "***not base64***"]}), 400)
    assert "images[1]" in error["message"] and "base64" in error["message"]
    error = error_of(client.post("/v1/classify", json={"images": [b64(good), b64(good), b64(b"GIF89a nope")]}), 400)
    assert "images[2]" in error["message"]


def test_top_k_above_the_number_of_labels_gives_every_label(client, engine, fashion):
    response = client.post("/v1/classify", json={"images": [b64(encode(fashion[0]))], "top_k": 1000})
    assert response.status_code == 200, response.text
    predictions = response.json()["predictions"][0]
    assert sorted(p["index"] for p in predictions) == list(range(len(engine.labels)))


@pytest.mark.parametrize("payload, fragment", [
    ({"images": []}, "images"),
    ({"images": ["x"], "top_k": 0}, "top_k"),
    ({"images": ["x"], "top_k": "three"}, "top_k"),
    ({"images": ["x"], "colour": True}, "colour"),
    ({"images": "x"}, "images"),
    ({"top_k": 3}, "images"),
    ({"images": ["x"], "version": 0}, "version"),
])
def test_invalid_json_fields_are_422(client, fashion, payload, fragment):
    if payload.get("images") == ["x"]:
        payload = {**payload, "images": [b64(encode(fashion[0]))]}
    error = error_of(client.post("/v1/classify", json=payload), 422)
    assert error["type"] == "invalid_request" and fragment in error["message"]


def test_malformed_json_is_422(client):
    error = error_of(client.post("/v1/classify", content=b"{not json", headers={"content-type": "application/json"}),
                     422)
    assert error["type"] == "invalid_request"


@pytest.mark.parametrize("fields, fragment", [
    ({"top_k": 0}, "top_k"), ({"top_k": "three"}, "top_k"), ({"timeout_ms": "1e9"}, "timeout_ms"),
    ({"colour": "red"}, "colour"), ({"version": "one"}, "version"),
])
def test_invalid_form_fields_are_422(client, fashion, fields, fragment):
    error = error_of(client.post("/v1/classify", **multipart(encode(fashion[0]), **fields)), 422)
    assert fragment in error["message"]


def test_multipart_without_files_or_with_text_files(client):
    error = error_of(client.post("/v1/classify", data={"top_k": "3"}, files=[("other", ("a.txt", b"x"))]), 422)
    assert "other" in error["message"]
    body, content_type = b"--b\r\nContent-Disposition: form-data; name=\"top_k\"\r\n\r\n3\r\n--b--\r\n", \
        "multipart/form-data; boundary=b"
    assert "files" in error_of(client.post("/v1/classify", content=body, headers={"content-type": content_type}),
                               422)["message"]
    text_part = b"--b\r\nContent-Disposition: form-data; name=\"files\"\r\n\r\niVBORw0K\r\n--b--\r\n"
    error = error_of(client.post("/v1/classify", content=text_part, headers={"content-type": content_type}), 400)
    assert "files[0]" in error["message"]
    error_of(client.post("/v1/classify", content=b"garbage", headers={"content-type": "multipart/form-data"}), 400)


def test_unknown_models_versions_and_bad_timeouts(client, fashion):
    image = b64(encode(fashion[0]))
    error_of(client.post("/v1/classify", json={"images": [image], "model": "nope"}), 404)
    error_of(client.post("/v1/classify", json={"images": [image], "version": 7}), 404)
    assert "timeout_ms" in error_of(client.post("/v1/classify", json={"images": [image], "timeout_ms": 10**6}),
                                    422)["message"]
    error_of(client.post("/v1/classify", json={"images": [image], "timeout_ms": 1}), 504)


# --- documentation and metrics ------------------------------------------------------------------------------

def test_openapi_documents_both_body_types(client):
    operation = client.get("/openapi.json").json()["paths"]["/v1/classify"]["post"]
    assert operation["summary"] and operation["description"]
    content = operation["requestBody"]["content"]
    form = content["multipart/form-data"]["schema"]
    assert form["properties"]["files"]["type"] == "array" and form["properties"]["files"]["items"]["format"] == "binary"
    assert {"top_k", "model", "version", "timeout_ms"} <= set(form["properties"])
    json_fields = set(content["application/json"]["schema"]["properties"])
    assert {"images", "top_k", "model", "version", "timeout_ms"} <= json_fields
    assert {"200", "400", "413", "415", "422", "429", "504"} <= set(operation["responses"])
    assert "ClassifyResponse" in str(operation["responses"]["200"])


def test_metrics_count_classified_images(client, fashion):
    client.post("/v1/classify", json={"images": [b64(encode(fashion[0]))] * 3})
    text = client.get("/metrics").text
    images = [line for line in text.splitlines() if line.startswith('tserve_images_total{model="vit",version="1"}')]
    assert images and float(images[0].split()[-1]) >= 3
    assert 'tserve_batch_size_count{model="vit",version="1"}' in text
    assert 'tserve_queue_wait_seconds_count{mode="classify",model="vit",version="1"}' in text
