"""Hostile inputs of the third probe (issue 25), through the ASGI app on the tiny models: chat content bounded
and tokenized off the event loop; lone surrogates in any text field of any API (a 4xx naming the field, never a
500); Open Inference Protocol shapes past int64, inputs of the wrong datatype, a header length in non-ASCII
digits, pixels out of [0, 1], `parameters` that would replace the input tensors, booleans where a number is
meant; numbers past Python's 4,300-digit conversion limit; `min_new_tokens` above `max_new_tokens`; the OpenAI
stream's error types; and no NaN or infinity in any response, whatever the model computes.

Bodies are sent as bytes with non-ASCII escaped (`json.dumps`), so that a lone surrogate goes out as the escape
`\\ud800`, as a hostile client sends it.
"""

from __future__ import annotations

import asyncio
import json
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from service.api.oip.protocol import parse_request
from service.api.openai import render as openai_render
from service.api.openai.errors import OPENAI
from service.api.openai.protocol import MAX_CONTENT_PARTS
from service.errors import BadInput, DeadlineExceeded, QueueFull, ServiceError, Unavailable
from service.http.errors import error_payload
from service.serving.streaming import Finished
from service.settings import Settings

pytestmark = pytest.mark.slow

MAX_TEXT_CHARS, MAX_TEXTS, MAX_NEW_TOKENS = 300, 32, 60
JSON = {"content-type": "application/json"}
CHAT = {"model": "gpt", "max_tokens": 4}
USER = {"role": "user", "content": "Good morrow."}


@pytest.fixture(scope="module")
def client(tiny_repository, serving):
    settings = Settings(repository=tiny_repository, max_text_chars=MAX_TEXT_CHARS, max_texts=MAX_TEXTS,
                        max_new_tokens=MAX_NEW_TOKENS, max_timeout_ms=60_000, max_images=8)
    with serving(settings) as client:
        yield client


def post(client, path: str, payload, headers: dict | None = None):
    """POST `payload` as JSON with non-ASCII escaped (bytes are sent as they are)."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return client.post(path, content=body, headers={**JSON, **(headers or {})})


def error_message(response, status: int) -> str:
    """The error message of a JSON error response of `status`, in whichever API's shape."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    error = response.json()["error"]
    return error if isinstance(error, str) else error["message"]


class RecordingTokenizer:
    """The engine's tokenizer, recording for every `encode` whether it ran on an event loop's thread."""

    def __init__(self, inner):
        self.inner = inner
        self.on_loop: list[bool] = []

    def encode(self, *args, **kwargs):
        try:
            asyncio.get_running_loop()
            self.on_loop.append(True)
        except RuntimeError:
            self.on_loop.append(False)
        return self.inner.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def recorded(client, monkeypatch):
    """The tokenizer of every loaded text model replaced by a RecordingTokenizer (restored after the test)."""
    recorders = {}
    for kind in ("gpt", "translation"):
        engine = client.app.state.registry.resolve(kind, None, None).engine
        recorders[kind] = RecordingTokenizer(engine.tokenizer)
        monkeypatch.setattr(engine, "tokenizer", recorders[kind])
    return recorders


# --- 1. chat content: bounded as prompts are, checked before anything is tokenized, tokenized off the loop -------

@pytest.mark.parametrize("messages, fragments", [
    ([{"role": "user", "content": "x" * (MAX_TEXT_CHARS + 1)}], ("messages.0.content", str(MAX_TEXT_CHARS))),
    ([USER, {"role": "user", "content": [{"type": "text", "text": "x" * (MAX_TEXT_CHARS + 1)}]}],
     ("messages.1.content.0.text", str(MAX_TEXT_CHARS))),
    ([{"role": "user", "content": [{"type": "text", "text": "x"}] * (MAX_CONTENT_PARTS + 1)}],
     ("messages.0.content", str(MAX_CONTENT_PARTS))),
    # every message within the limit, the conversation not: the prompt's limit holds for the whole conversation
    ([{"role": "user", "content": "x" * 100}] * 4, ("TSERVE_MAX_TEXT_CHARS", "400 characters")),
    ([{"role": "system", "content": [{"type": "text", "text": "x" * 200}] * 2}], ("TSERVE_MAX_TEXT_CHARS",)),
])
def test_chat_content_is_bounded_before_it_is_tokenized(client, recorded, messages, fragments):
    message = error_message(post(client, "/v1/chat/completions", {**CHAT, "messages": messages}), 400)
    assert all(fragment in message for fragment in fragments), message
    assert recorded["gpt"].on_loop == [], "the over-long conversation was tokenized"


@pytest.mark.parametrize("path, payload", [
    ("/v1/chat/completions", {**CHAT, "messages": [USER]}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
    ("/v1/completions", {**CHAT, "prompt": ["ROMEO:\n", "JULIET:\n"]}),
    ("/v1/generate", {"prompt": "ROMEO:\n", "max_new_tokens": 4}),
    ("/v1/translate", {"text": ["Ein Hund.", "Zwei Hunde."], "num_beams": 1, "max_new_tokens": 4}),
    ("/v2/models/gpt/infer", {"inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": ["Hi"]}],
                              "parameters": {"max_new_tokens": 4}}),
])
def test_prompts_are_tokenized_off_the_event_loop(client, recorded, path, payload):
    response = post(client, path, payload)
    assert response.status_code == 200, response.text
    calls = recorded["translation" if "translate" in path else "gpt"].on_loop
    assert calls and not any(calls), f"{calls.count(True)} of {len(calls)} encodes ran on the event loop"


# --- 2. lone surrogates: every text field, every API, a 4xx naming the field -------------------------------------

def oip_prompt(prompt="Hi", **changes) -> dict:
    return {"inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": [prompt]}],
            "parameters": {"max_new_tokens": 4}, **changes}


@pytest.mark.parametrize("path, payload, status, fragment", [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "O \ud800 Romeo"}]}, 400,
     "messages.0.content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\udfff"}]}, 400, "messages.0.content"),
    ("/v1/chat/completions", {**CHAT, "messages": [USER, {"role": "user", "content": [
        {"type": "text", "text": "ok"}, {"type": "text", "text": "O \ud800"}]}]}, 400, "messages.1.content.1.text"),
    ("/v1/chat/completions", {**CHAT, "messages": [{**USER, "name": "\ud800"}]}, 400, "messages.0.name"),
    ("/v1/chat/completions", {**CHAT, "messages": [USER], "user": "\ud800"}, 400, "user"),
    ("/v1/chat/completions", {**CHAT, "messages": [USER], "\ud800": 1}, 400, "field name"),
    ("/v1/completions", {**CHAT, "prompt": "ROMEO:\n", "user": "\udc80"}, 400, "user"),
    ("/v1/completions", {**CHAT, "prompt": ["ok", "O \ud800"]}, 400, "prompt.1"),
    ("/v1/generate", {"prompt": "ROMEO:\n", "\ud800": 1}, 422, "field name"),
    ("/v1/generate", {"prompt": "O \ud800"}, 422, "prompt"),
    ("/v1/translate", {"text": ["Ein Hund.", "Ein \udfff"], "num_beams": 1}, 422, "text.1"),
    ("/v1/classify", {"images": ["\ud800"]}, 422, "images.0"),
    ("/v2/models/gpt/infer", oip_prompt("O \ud800"), 400, "inputs.0.data.0"),
    ("/v2/models/gpt/infer", oip_prompt(id="\ud800"), 400, "id"),
    ("/v2/models/gpt/infer", oip_prompt(parameters={"\ud800": 1}), 400, "field name"),
    ("/v2/models/gpt/infer", oip_prompt(parameters={"max_new_tokens": 4, "stop": "\ud800"}), 400, "parameters.stop"),
    ("/v2/models/translation/infer", {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES",
                                                  "data": ["\ud800"]}]}, 400, "inputs.0.data.0"),
    ("/v2/models/gpt/infer", oip_prompt(outputs=[{"name": "\ud800"}]), 400, "outputs.0.name"),
])
def test_a_lone_surrogate_in_any_text_field_is_a_4xx_naming_it(client, path, payload, status, fragment):
    message = error_message(post(client, path, payload), status)
    assert fragment in message and "unicode" in message, message


# --- 3, 4, 5. Open Inference Protocol tensors: shapes, datatypes, the header length ------------------------------

def binary_body(header: dict, raw: bytes) -> tuple[bytes, dict]:
    encoded = json.dumps(header).encode()
    return encoded + raw, {"inference-header-content-length": str(len(encoded)),
                           "content-type": "application/octet-stream"}


def bytes_element(value: bytes) -> bytes:
    return struct.pack("<I", len(value)) + value


@pytest.mark.parametrize("model, tensor", [
    # the int64 product of these shapes wraps to 0, so no data "fits" them
    ("translation", {"name": "TEXT", "shape": [2147483648] * 3, "datatype": "BYTES", "data": []}),
    ("gpt", {"name": "PROMPT", "shape": [65536] * 4, "datatype": "BYTES", "data": []}),
    ("gpt", {"name": "PROMPT", "shape": [0, 2**31, 2**31, 2**31], "datatype": "BYTES", "data": []}),
    ("vit", {"name": "PIXELS", "shape": [2**31, 2**31, 2**31, 2], "datatype": "FP32", "data": []}),
    ("vit", {"name": "IMAGE", "shape": [2**31] * 3, "datatype": "BYTES", "binary": b""}),
    ("vit", {"name": "PIXELS", "shape": [2**32, 2**32], "datatype": "FP32", "binary": b""}),
    ("vit", {"name": "IMAGE", "shape": [2**62, 2**62], "datatype": "BYTES", "binary": bytes_element(b"x")}),
])
def test_a_shape_past_int64_is_a_400(client, model, tensor):
    raw = tensor.pop("binary", None)
    if raw is None:
        response = post(client, f"/v2/models/{model}/infer", {"inputs": [tensor]})
    else:
        body, headers = binary_body({"inputs": [{**tensor, "parameters": {"binary_data_size": len(raw)}}]}, raw)
        response = client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    message = error_message(response, 400)
    assert tensor["name"] in message and "shape" in message, message


@pytest.mark.parametrize("model, name, datatype, data", [
    ("vit", "IMAGE", "FP32", [0.5]),
    ("vit", "IMAGE", "UINT8", [1]),
    ("vit", "PIXELS", "FP64", [0.5] * 784),
    ("vit", "PIXELS", "BYTES", ["a"] * 784),
    ("translation", "TEXT", "INT32", [1]),
    ("translation", "TEXT", "BOOL", [True]),
    ("gpt", "PROMPT", "FP32", [1.0]),
])
def test_an_input_of_the_wrong_datatype_is_a_400_naming_it(client, model, name, datatype, data):
    shape = [1, 28, 28] if name == "PIXELS" else [1]
    response = post(client, f"/v2/models/{model}/infer",
                    {"inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": data}]})
    message = error_message(response, 400)
    assert name in message and datatype in message, message


# What the server reads from a header is its bytes as latin-1 (ASGI): b"\xb2" arrives as "²", which str.isdigit()
# takes for a digit and int() does not.
@pytest.mark.parametrize("length", ["\xb2", "\xb9", "1\xb3", "\xb2\xb2", "9" * 5000, "1" + "0" * 5000, " 2", "-2",
                                    "+2", "2_0", ""])
def test_a_header_length_not_in_ascii_digits_is_a_400(length):
    body, _ = binary_body(oip_prompt(), b"")
    with pytest.raises(BadInput, match="Inference-Header-Content-Length"):
        parse_request(body, length)


def test_a_header_length_with_leading_zeros_is_read():
    body, headers = binary_body(oip_prompt(), b"")
    request, tensors, _ = parse_request(body, "0" * 5000 + headers["inference-header-content-length"])
    assert list(tensors) == ["PROMPT"] and request.parameters == {"max_new_tokens": 4}


@pytest.mark.parametrize("length", ["9" * 5000, "-2"])
def test_a_header_length_not_in_ascii_digits_is_a_400_over_http(client, length):
    body, headers = binary_body(oip_prompt(), b"")
    response = client.post("/v2/models/gpt/infer", content=body,
                           headers={**headers, "inference-header-content-length": length})
    assert "Inference-Header-Content-Length" in error_message(response, 400)


# --- 9. pixels out of range, and no NaN or infinity in any response --------------------------------------------

def pixels_request(values: np.ndarray, binary: bool) -> tuple[bytes, dict]:
    tensor = {"name": "PIXELS", "shape": list(values.shape), "datatype": "FP32"}
    if binary:
        raw = values.astype("<f4").tobytes()
        return binary_body({"inputs": [{**tensor, "parameters": {"binary_data_size": len(raw)}}]}, raw)
    return json.dumps({"inputs": [{**tensor, "data": values.reshape(-1).tolist()}]}).encode(), JSON


FINITE_OUT_OF_RANGE = [1e38, -1e38, 3e38, 1.5, -0.01]


# JSON has no NaN or infinity, so those go in binary only
@pytest.mark.parametrize("value, binary", [(v, b) for v in FINITE_OUT_OF_RANGE for b in (True, False)] +
                         [(float("nan"), True), (float("inf"), True), (float("-inf"), True)])
def test_pixels_out_of_range_are_a_400(client, value, binary):
    pixels = np.full((1, 28, 28), 0.5, dtype=np.float32)
    pixels[0, 3, 4] = value
    body, headers = pixels_request(pixels, binary)
    message = error_message(client.post("/v2/models/vit/infer", content=body, headers=headers), 400)
    assert "PIXELS" in message and "[0, 1]" in message, message


def test_pixels_at_the_range_ends_are_served(client):
    pixels = np.zeros((2, 28, 28), dtype=np.float32)
    pixels[1] = 1.0
    body, headers = pixels_request(pixels, binary=False)
    response = client.post("/v2/models/vit/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text


def _png() -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (28, 28), 128).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("path, payload", [
    ("/v1/classify", {"images": [_png(), _png()]}),
    ("/v2/models/vit/infer", {"inputs": [{"name": "PIXELS", "shape": [2, 28, 28], "datatype": "FP32",
                                          "data": [0.5] * 2 * 784}]}),
    ("/v2/models/vit/infer", {"inputs": [{"name": "PIXELS", "shape": [2, 28, 28], "datatype": "FP32",
                                          "data": [0.5] * 2 * 784}],
                              "outputs": [{"name": "PROBABILITIES", "parameters": {"classification": 2}}]}),
])
def test_non_finite_model_output_is_an_explicit_error_never_nan_in_json(client, monkeypatch, bad, path, payload):
    engine = client.app.state.registry.resolve("vit", None, None).engine
    real = engine.logits

    def broken(batch):
        logits = real(batch)
        logits[-1, 0] = bad  # the last image of the batch
        return logits

    monkeypatch.setattr(engine, "logits", broken)
    response = post(client, path, payload)
    json.loads(response.text, parse_constant=lambda c: pytest.fail(f"{c} in the response body"))
    message = error_message(response, 500)
    assert "non-finite" in message and "[1]" in message, message


# --- 10. OIP parameters: options only; the tensors and their limits are the tensors' ----------------------------

def oip_texts(model: str, texts: list[str], parameters: dict) -> tuple[str, dict]:
    name = "TEXT" if model == "translation" else "PROMPT"
    return f"/v2/models/{model}/infer", {
        "inputs": [{"name": name, "shape": [len(texts)], "datatype": "BYTES", "data": texts}],
        "parameters": parameters}


@pytest.mark.parametrize("model, texts, parameters, fragment", [
    ("translation", ["x" * (MAX_TEXT_CHARS + 1)] * 3, {"text": "a", "num_beams": 1}, "'text'"),
    ("translation", ["Hallo."] * (MAX_TEXTS + 1), {"text": "a", "num_beams": 1}, "'text'"),
    ("translation", ["Hallo."], {"text": ["a"], "num_beams": 1}, "'text'"),
    ("gpt", ["x" * (MAX_TEXT_CHARS + 1)], {"prompt": "a", "max_new_tokens": 4}, "'prompt'"),
    ("gpt", ["Hi"], {"model": "translation", "max_new_tokens": 4}, "'model'"),
    ("gpt", ["Hi"], {"version": 2, "max_new_tokens": 4}, "'version'"),
    ("translation", ["Hallo."], {"timeout_ms": 1, "num_beams": 1}, "'timeout_ms'"),
    ("translation", ["Hallo."], {"stream": False}, "'stream'"),
    ("gpt", ["Hi"], {"colour": "blue"}, "colour"),
    # without parameters, the tensors' own limits still hold
    ("translation", ["x" * (MAX_TEXT_CHARS + 1)], {"num_beams": 1}, str(MAX_TEXT_CHARS)),
    ("translation", ["Hallo."] * (MAX_TEXTS + 1), {"num_beams": 1}, str(MAX_TEXTS)),
    ("gpt", ["x" * (MAX_TEXT_CHARS + 1)], {"max_new_tokens": 4}, str(MAX_TEXT_CHARS)),
])
def test_parameters_cannot_replace_the_tensors_or_their_limits(client, model, texts, parameters, fragment):
    path, payload = oip_texts(model, texts, parameters)
    message = error_message(post(client, path, payload), 400)
    assert fragment in message, message


# --- 15. the smaller inconsistencies ----------------------------------------------------------------------------

HUGE = "9" * 5000  # past Python's 4,300-digit limit on converting a decimal string to an int


@pytest.mark.parametrize("path, body, status", [
    ("/v1/generate", '{"prompt": "x", "seed": %s}' % HUGE, 422),
    ("/v1/translate", '{"text": "Hallo.", "num_beams": %s}' % HUGE, 422),
    ("/v1/classify", '{"images": ["x"], "top_k": %s}' % HUGE, 422),
    ("/v1/completions", '{"model": "gpt", "prompt": "x", "seed": %s}' % HUGE, 400),
    ("/v2/models/gpt/infer", '{"inputs": [], "id": %s}' % HUGE, 400),
])
def test_a_number_past_the_digit_limit_is_a_validation_error(client, path, body, status):
    response = post(client, path, body.encode())
    message = error_message(response, status)
    assert "digits" in message, message
    if path.startswith("/v1/") and path not in ("/v1/completions",):
        assert response.json()["error"]["type"] == "invalid_request", response.json()
    elif path == "/v1/completions":
        assert response.json()["error"]["type"] == "invalid_request_error", response.json()


@pytest.mark.parametrize("path, payload", [
    ("/v1/generate", {"prompt": "ROMEO:\n", "max_new_tokens": 5, "min_new_tokens": 6}),
    ("/v1/generate", {"prompt": "ROMEO:\n", "max_new_tokens": 1, "min_new_tokens": MAX_NEW_TOKENS, "stream": True}),
    ("/v1/translate", {"text": "Hallo.", "max_new_tokens": 5, "min_new_tokens": 6}),
    ("/v1/translate", {"text": "Hallo.", "max_new_tokens": 2, "min_new_tokens": 3, "num_beams": 1, "stream": True}),
    oip_texts("gpt", ["Hi"], {"max_new_tokens": 2, "min_new_tokens": 3}),
    oip_texts("translation", ["Hallo."], {"max_new_tokens": 2, "min_new_tokens": 3}),
])
def test_min_new_tokens_above_max_new_tokens_is_refused(client, path, payload):
    """400, not 422: each value conforms to the schema, which cannot compare two fields (the README's contract,
    as for num_return_sequences above num_beams)."""
    message = error_message(post(client, path, payload), 400)
    assert "min_new_tokens" in message and "max_new_tokens" in message, message


@pytest.mark.parametrize("changes, fragment", [
    ({"parameters": {"timeout": True}}, "timeout"),
    ({"parameters": {"timeout": 1.5e6}}, "timeout"),
    ({"parameters": {"timeout": "5000000"}}, "timeout"),
    ({"parameters": {"binary_data_output": 1}}, "binary_data_output"),
    ({"outputs": [{"name": "PROBABILITIES", "parameters": {"classification": True}}]}, "classification"),
    ({"outputs": [{"name": "PROBABILITIES", "parameters": {"classification": 2.0}}]}, "classification"),
    ({"outputs": [{"name": "PROBABILITIES", "parameters": {"binary_data": "yes"}}]}, "binary_data"),
])
def test_oip_parameters_of_the_wrong_type_are_a_400_naming_them(client, changes, fragment):
    payload = {"inputs": [{"name": "PIXELS", "shape": [1, 28, 28], "datatype": "FP32", "data": [0.5] * 784}],
               **changes}
    message = error_message(post(client, "/v2/models/vit/infer", payload), 400)
    assert fragment in message, message


def test_a_boolean_binary_data_size_is_a_400(client):
    raw = np.full((1, 28, 28), 0.5, dtype="<f4").tobytes()
    body, headers = binary_body({"inputs": [{"name": "PIXELS", "shape": [1, 28, 28], "datatype": "FP32",
                                             "parameters": {"binary_data_size": True}}]}, raw)
    assert "binary_data_size" in error_message(client.post("/v2/models/vit/infer", content=body, headers=headers),
                                               400)


async def _stream_error(error: ServiceError) -> dict:
    async def events():
        yield [Finished(0, error=error)]

    request = SimpleNamespace(state=SimpleNamespace())
    response = openai_render.event_stream(request, events(), lambda choices: {"choices": choices}, lambda d: {},
                                          None)
    chunks = [chunk async for chunk in response.body_iterator]
    events = [json.loads(line[len(b"data: "):]) for chunk in chunks for line in chunk.split(b"\n")
              if line.startswith(b"data: {")]
    (event,) = events
    return event["error"]


@pytest.mark.parametrize("error", [DeadlineExceeded("the request's deadline expired"), Unavailable("draining"),
                                   QueueFull("full", 1), BadInput("bad"), ServiceError("bug")],
                         ids=lambda e: type(e).__name__)
def test_an_openai_stream_error_has_the_type_of_the_same_error_unstreamed(error):
    streamed = asyncio.run(_stream_error(error))
    _, unstreamed = error_payload(OPENAI, error.status, error.type, error.message)
    assert streamed == unstreamed["error"], (streamed, unstreamed)


# --- the held-out prober: log-probabilities of a beam search -----------------------------------------------------

@pytest.mark.parametrize("body, status", [
    ({"best_of": 4, "n": 2, "logprobs": 3, "temperature": 0}, 400),  # a beam search: no per-token log-probabilities
    ({"best_of": 2, "logprobs": 0, "temperature": 0}, 400),
    ({"best_of": 4, "n": 2, "temperature": 0}, 200),  # the beam search itself is served
    ({"best_of": 4, "n": 2, "logprobs": 3, "temperature": 0.8, "seed": 1}, 200),  # sampled: every array filled
])
def test_completions_log_probabilities_are_whole_or_refused(client, body, status):
    response = client.post("/v1/completions", json={"model": "gpt", "prompt": "ROMEO:\n", "max_tokens": 5, **body})
    assert response.status_code == status, response.text
    if status == 400:
        assert response.json()["error"]["param"] == "logprobs"
        return
    for choice in response.json()["choices"]:
        logprobs = choice["logprobs"]
        if logprobs is not None:  # the four arrays: one entry per token, as clients zip them
            lengths = {len(logprobs[key]) for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
            assert lengths == {len(logprobs["tokens"])} and logprobs["tokens"], logprobs
