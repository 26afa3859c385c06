"""Hostile inputs of the fourth probe (issue 51), items 1, 3 and 7, through the ASGI app on the tiny models:
the tokenizer routes bounded by their own stated limit (`TSERVE_MAX_TOKENIZE_CHARS`) and run through the
tokenizer's GIL-releasing calls off the event loop; the lone-surrogate check of every request, at C speed per
value (a body of millions of strings took half a minute of the event loop); an
over-long translation source refused (never cut) on every route that reads one; and an echoed prompt's special
tokens rendered by one rule, its `text_offset` pointing at each token's text, for a text prompt and ids alike.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from service.api import fields
from service.api.fields import lone_surrogate
from service.api.oip.grpc.calls import status_code
from service.api.openai.protocol import openai_request_models
from service.api.tokenize import tokenize_request_models
from service.errors import BadInput
from service.settings import Settings

MAX_TOKENIZE_CHARS = 1_000
JSON = {"content-type": "application/json"}
END_OF_TEXT = "<|endoftext|>"  # the tiny GPT's only special token: id 256, after its 256 bytes


@pytest.fixture(scope="module")
def client(tiny_repository, serving):
    settings = Settings(repository=tiny_repository, max_tokenize_chars=MAX_TOKENIZE_CHARS, max_timeout_ms=60_000)
    with serving(settings) as client:
        yield client


def post(client, path: str, payload):
    """POST `payload` as JSON with non-ASCII escaped."""
    return client.post(path, content=json.dumps(payload).encode(), headers=JSON)


def error_of(response, status: int) -> dict:
    """The error object of a response of `status` in OpenAI's shape ({"message", "param", ...}), or the native and
    Open Inference Protocol's message as {"message"}."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    error = response.json()["error"]
    return {"message": error} if isinstance(error, str) else error


def engine_of(client, kind: str):
    return client.app.state.registry.resolve(kind, None, None).engine


class RecordingTokenizer:
    """An engine's tokenizer, recording each encode/decode call: (method, whether it ran on an event loop's thread)."""

    CALLS = ("encode", "encode_batch", "decode", "decode_batch")

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[str, bool]] = []

    def __getattr__(self, name):
        target = getattr(self.inner, name)
        if name not in self.CALLS:
            return target

        def call(*args, **kwargs):
            try:
                asyncio.get_running_loop()
                on_loop = True
            except RuntimeError:
                on_loop = False
            self.calls.append((name, on_loop))
            return target(*args, **kwargs)

        return call


@pytest.fixture
def recorded(client, monkeypatch):
    """The tiny GPT's tokenizer replaced by a RecordingTokenizer (restored after the test)."""
    engine = engine_of(client, "gpt")
    recorder = RecordingTokenizer(engine.tokenizer)
    monkeypatch.setattr(engine, "tokenizer", recorder)
    return recorder


# --- 1. the tokenizer routes: a stated bound, a 400 past it, the GIL released while tokenizing ------------------------

@pytest.mark.slow
@pytest.mark.parametrize("path, payload, param", [
    ("/tokenize", {"prompt": "x" * (MAX_TOKENIZE_CHARS + 1)}, "prompt"),
    ("/tokenize", {"model": "translation", "prompt": "Hallo " * MAX_TOKENIZE_CHARS}, "prompt"),
    ("/detokenize", {"tokens": [72] * (MAX_TOKENIZE_CHARS + 1)}, "tokens"),
])
def test_the_tokenizer_routes_refuse_past_their_bound_before_tokenizing(client, recorded, path, payload, param):
    error = error_of(post(client, path, payload), 400)
    assert error["param"] == param and str(MAX_TOKENIZE_CHARS) in error["message"], error
    assert recorded.calls == [], "the over-long input was tokenized"


@pytest.mark.slow
def test_the_tokenizer_routes_take_their_bound_and_tokenize_with_the_gil_released(client, recorded):
    """At the bound: every character one token of the byte-level GPT, through `encode_batch` / `decode_batch`
    (which release the GIL; `encode`/`decode` hold it, and the event loop with it) on a worker thread."""
    text = "x" * MAX_TOKENIZE_CHARS
    tokenized = post(client, "/tokenize", {"prompt": text}).json()
    assert tokenized["count"] == MAX_TOKENIZE_CHARS
    assert post(client, "/detokenize", {"tokens": tokenized["tokens"]}).json() == {"prompt": text}
    assert recorded.calls == [("encode_batch", False), ("decode_batch", False)], recorded.calls


def test_the_openapi_schema_states_the_tokenizer_bound():
    models = tokenize_request_models(Settings(max_tokenize_chars=MAX_TOKENIZE_CHARS),
                                     openai_request_models(Settings()).chat)
    prompt = models.tokenize.model_json_schema()["properties"]["prompt"]
    assert MAX_TOKENIZE_CHARS in [member.get("maxLength") for member in prompt["anyOf"]]
    assert "TSERVE_MAX_TOKENIZE_CHARS" in prompt["description"]
    tokens = models.detokenize.model_json_schema()["properties"]["tokens"]
    assert tokens["maxItems"] == MAX_TOKENIZE_CHARS and "TSERVE_MAX_TOKENIZE_CHARS" in tokens["description"]


# --- 1. the lone-surrogate check costs C speed per value --------------------------------------------------------------

@pytest.mark.parametrize("data, found", [
    ("x", None), ({"a": "ok", "b": [1, 2.5, None, True]}, None), ({1: "x"}, None), ([], None), ({}, None),
    ({"a": "O \ud800"}, (("a",), None, "\ud800")),
    ({"\ud800": 1}, ((), "\ud800", "\ud800")),
    ({"m": [{"c": "ok"}, {"c": [{"t": "x"}, {"t": "\udfff"}]}]}, (("m", 1, "c", 1, "t"), None, "\udfff")),
    (["\ud83d", "\ude00"], ((0,), None, "\ud83d")),  # a pair split over two strings is two lone surrogates
    ([[1], ["a", ["b\udc00"]]], ((1, 1, 0), None, "\udc00")),
    ({"a": {"\udc01": 1}, "b": "\ud801"}, (("a",), "\udc01", "\udc01")),  # document order: a's field name first
    (["ok"] * 5_000 + ["\ud800"] + ["ok"] * 5_000, ((5_000,), None, "\ud800")),
])
def test_lone_surrogate_finds_the_first_in_document_order(data, found):
    assert lone_surrogate(data) == found


@pytest.mark.parametrize("data", [["a"] * 100_000, [["a"]] * 100_000, [{"a": "b"}] * 100_000,
                                  ["a"] * 100_000 + ["\ud800"]])
def test_lone_surrogate_checks_many_strings_at_once(monkeypatch, data):
    """Strings are joined and checked together, not one by one (a body of millions of strings took half a minute
    of the event loop): a check per level of nesting, per slice of a list looked into for the first lone surrogate
    and per item of the one slice that holds it, not one per string."""
    checks = []
    inner = fields._surrogate_in
    monkeypatch.setattr(fields, "_surrogate_in", lambda text: checks.append(text) or inner(text))
    lone_surrogate({"prompt": data})
    most = len(data) // fields.SURROGATE_SLICE + fields.SURROGATE_SLICE + 10
    assert len(checks) <= most, f"{len(checks)} checks for {len(data)} values"


# --- 3. an over-long translation source: a 400 naming the limit on every route, never cut -----------------------------

def source_tokens(engine, text: str) -> int:
    """The tokens the translator reads of `text`: its tokenizer's, and the end-of-source token."""
    return len(engine.tokenizer.encode(text).ids) + 1


def long_source(engine) -> str:
    """A German text of more tokens than the tiny translator reads, well within the generation routes' characters."""
    text = "Ein Mann fährt mit dem Fahrrad."
    while source_tokens(engine, text) <= engine.max_source_length:
        text += " Ein Mann fährt mit dem Fahrrad."
    assert len(text) <= Settings().max_text_chars
    return text


@pytest.mark.slow
@pytest.mark.parametrize("path, payload, named", [
    ("/v1/translate", lambda text: {"text": text, "num_beams": 1, "max_new_tokens": 4}, "text 0"),
    ("/v1/translate", lambda text: {"text": ["Hallo.", text], "num_beams": 2, "max_new_tokens": 4}, "text 1"),
    ("/v1/translate", lambda text: {"text": text, "num_beams": 1, "stream": True}, "text 0"),
    ("/v1/translate/score", lambda text: {"source": text, "target": "A man."}, "source 0"),
    ("/v1/translate/score", lambda text: {"source": ["Hallo.", text], "target": ["Hello.", "A man."]}, "source 1"),
    ("/v2/models/translation/infer", lambda text: {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES",
                                                               "data": [text]}]}, "text 0"),
])
def test_an_over_long_source_is_a_400_naming_the_limit(client, path, payload, named):
    engine = engine_of(client, "translation")
    text = long_source(engine)
    tokens = source_tokens(engine, text)
    message = error_of(post(client, path, payload(text)), 400)["message"]
    for fragment in (named, f"has {tokens} tokens", f"at most {engine.max_source_length}", "max_source_length"):
        assert fragment in message, message


def test_an_over_long_source_is_invalid_argument_over_grpc():
    """gRPC maps the same error (a BadInput) to INVALID_ARGUMENT with its message (`service.api.oip.grpc.calls`)."""
    assert status_code(BadInput("text 0 has 300 tokens")) == grpc.StatusCode.INVALID_ARGUMENT


# --- 7. an echoed prompt's special tokens: one rule for text, tokens and offsets --------------------------------------

def echoed(client, prompt, max_tokens: int = 0) -> dict:
    response = post(client, "/v1/completions", {"model": "gpt", "prompt": prompt, "max_tokens": max_tokens,
                                                "echo": True, "logprobs": 0, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def assert_offsets_point_at_tokens(choice: dict) -> None:
    text, logprobs = choice["text"], choice["logprobs"]
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"], strict=True):
        if not token.startswith("bytes:"):  # part of a character: it has no text of its own
            assert text[offset : offset + len(token)] == token, (text, logprobs)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", ["a<|endoftext|>b", [97, 256, 98]], ids=["text", "ids"])
def test_an_echoed_special_token_is_its_content_in_text_tokens_and_offsets(client, prompt):
    choice = echoed(client, prompt)
    assert choice["text"] == f"a{END_OF_TEXT}b"
    assert choice["logprobs"]["tokens"] == ["a", END_OF_TEXT, "b"]
    assert choice["logprobs"]["text_offset"] == [0, 1, 1 + len(END_OF_TEXT)]
    assert_offsets_point_at_tokens(choice)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [f"ROMEO:{END_OF_TEXT}\nJULIET:", [256, 82, 79, 77, 69, 79, 58, 256, 10]],
                         ids=["text", "ids"])
def test_the_generated_tokens_offsets_follow_an_echoed_special_token(client, prompt):
    choice = echoed(client, prompt, max_tokens=8)
    assert END_OF_TEXT in choice["text"] and len(choice["logprobs"]["tokens"]) > 8
    assert_offsets_point_at_tokens(choice)


@pytest.mark.parametrize("field", ["inputs", "outputs"])
def test_an_oip_request_naming_more_tensors_than_any_model_has_is_refused_by_its_count(client, field):
    """Half a million tensor objects would be validated one by one; the count refuses them first."""
    from service.api.oip.protocol import MAX_TENSORS

    text = {"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["Hallo"]}
    body = {"inputs": [text], field: [text if field == "inputs" else {"name": "TRANSLATION"}] * (MAX_TENSORS + 1)}
    message = error_of(post(client, "/v2/models/translation/infer", body), 400)["message"]
    assert field in message and str(MAX_TENSORS) in message, message
