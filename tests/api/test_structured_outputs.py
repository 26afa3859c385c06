"""Structured outputs through every API, against a real server on the tiny GPT (a context of 64 byte tokens): the
real `openai` SDK's `chat.completions.parse` with a pydantic model (and `beta.chat.completions.parse`), OpenAI's
`response_format`, vLLM's `structured_outputs` and `guided_*`, the native `/v1/generate` fields and the Open Inference
Protocol's parameters over REST and gRPC give the same greedy constrained text; a stream's chunks join to the
unstreamed text; `n` sampled choices, stop strings and log-probabilities pass through. A constraint that cannot
compile, or a second one, is a 400 naming the field on every API (gRPC: INVALID_ARGUMENT), streamed or not; beam
search under a constraint is refused naming a field the client sent; the constraint metrics count by kind, and the
same schema twice is one cache miss then a hit.
"""

from __future__ import annotations

import json
import queue
import re
import uuid
from typing import Literal

import httpx
import numpy as np
import openai
import pytest
import tritonclient.grpc as tgrpc
from pydantic import BaseModel, Field
from tritonclient.utils import InferenceServerException

from service.client.processes import free_port
from service.client.sse import parse_sse
from tests.support.metrics import metric, scrape
from tests.support.triton_inputs import grpc_text_input

pytestmark = pytest.mark.slow

PROMPT = "ROMEO:\n"
MESSAGES = [{"role": "user", "content": "Hi"}]
GREEDY_TOKENS = 40  # the JSON of `Reply` is ~32 bytes: it completes (finish_reason "stop") within this many
STREAM_WAIT_S = 30.0


class Reply(BaseModel):
    """Small enough for the tiny GPT's context: enums, a bounded integer, a boolean."""

    mood: Literal["happy", "sad"]
    n: int = Field(ge=0, le=9)
    ok: bool


SCHEMA = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "ok": {"type": "boolean"}},
          "required": ["mood", "n", "ok"], "additionalProperties": False}
REGEX, CHOICES, GRAMMAR = r"[a-z]{2,5} [0-9]{2}", ["to be", "not to be"], 'start: "thou " ("art" | "wast")'
# the constraints that cannot compile, by (kind, value): each API names its own field
BAD = [("json_schema", {"type": "string", "format": "bogus"}), ("json_schema", {"type": "nope"}),
       ("regex", "a(b"), ("grammar", 'start: "a" ]['), ("choice", [])]


@pytest.fixture(scope="module")
def server(server_factory):
    with server_factory("structured outputs server", models='["gpt"]', max_new_tokens=60,
                        grpc_port=free_port()) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def rest(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(server):
    c = tgrpc.InferenceServerClient(f"127.0.0.1:{server.knobs['TSERVE_GRPC_PORT']}")
    yield c
    c.close()


def _oip_value(kind: str, value):
    """A constraint as an Open Inference Protocol parameter: a schema and a choice list as JSON text."""
    return json.dumps(value) if kind in ("json_schema", "choice") else value


def _oip(rest, parameters: dict) -> httpx.Response:
    return rest.post("/v2/models/gpt/infer", json={
        "inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": [PROMPT]}],
        "parameters": {"max_new_tokens": GREEDY_TOKENS, "temperature": 0, **parameters}})


def _grpc(grpc_client, parameters: dict) -> str:
    result = grpc_client.infer("gpt", [grpc_text_input("PROMPT", [PROMPT])],
                               parameters={"max_new_tokens": GREEDY_TOKENS, "temperature": 0, **parameters})
    return result.as_numpy("TEXT")[0].decode()


# --- the SDK's structured-output helper -----------------------------------------------------------------------


def test_the_sdks_parse_returns_the_pydantic_object(client):
    helpers = [client.chat.completions.parse]
    if hasattr(client, "beta") and hasattr(client.beta.chat.completions, "parse"):
        helpers.append(client.beta.chat.completions.parse)
    for parse in helpers:
        completion = parse(model="gpt", messages=MESSAGES, response_format=Reply, max_tokens=GREEDY_TOKENS,
                           temperature=0)
        (choice,) = completion.choices
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Reply)
        assert choice.message.parsed == Reply.model_validate_json(choice.message.content)
    sampled = client.chat.completions.parse(model="gpt", messages=MESSAGES, response_format=Reply,
                                            max_tokens=GREEDY_TOKENS, temperature=1.0, seed=3, n=2)
    assert len(sampled.choices) == 2 and all(isinstance(c.message.parsed, Reply) for c in sampled.choices)


# --- every API, one constraint ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, value, vllm", [("json_schema", SCHEMA, "json"), ("regex", REGEX, "regex"),
                                               ("choice", CHOICES, "choice"), ("grammar", GRAMMAR, "grammar")])
def test_every_api_gives_the_same_greedy_constrained_text(client, rest, grpc_client, kind, value, vllm):
    native = rest.post("/v1/generate", json={"prompt": PROMPT, "max_new_tokens": GREEDY_TOKENS, "temperature": 0,
                                             kind: value})
    assert native.status_code == 200, native.text
    text = native.json()["text"]
    assert native.json()["finish_reason"] == "stop"
    if kind == "json_schema":
        Reply.model_validate_json(text)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert text in ("thou art", "thou wast")
    vllm_field = f"guided_{vllm}" if vllm != "json" else "guided_json"
    ways = [{"structured_outputs": {vllm: value}}, {vllm_field: value}]
    if kind == "json_schema":
        ways += [{"response_format": {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA,
                                                                             "strict": False}}},
                 {"guided_json": json.dumps(SCHEMA)}]  # vLLM takes a schema as JSON text too
    for extra in ways:
        completion = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=GREEDY_TOKENS,
                                               temperature=0, extra_body=extra)
        assert completion.choices[0].text == text, extra
    oip = _oip(rest, {kind: _oip_value(kind, value)})
    assert oip.status_code == 200, oip.text
    assert oip.json()["outputs"][0]["data"] == [text]
    assert _grpc(grpc_client, {kind: _oip_value(kind, value)}) == text


def test_json_object_is_an_object(client):
    json_object = {"type": "json_object"}
    chat = client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=GREEDY_TOKENS, temperature=0,
                                          response_format=json_object)
    completion = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=GREEDY_TOKENS, temperature=0,
                                           extra_body={"response_format": json_object})  # vLLM's, not the SDK's
    for text in (chat.choices[0].message.content, completion.choices[0].text):
        assert isinstance(json.loads(text), dict)
    text = client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=8, temperature=0,
                                          response_format={"type": "text"}).choices[0].message.content
    assert text  # no constraint


def test_a_stream_joins_to_the_unstreamed_text(client, rest, grpc_client):
    form = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    whole = client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=GREEDY_TOKENS, temperature=0,
                                           response_format=form).choices[0].message.content
    chunks = list(client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=GREEDY_TOKENS,
                                                 temperature=0, response_format=form, stream=True))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1 and "".join(pieces) == whole
    Reply.model_validate_json(whole)
    body = {"prompt": PROMPT, "max_new_tokens": GREEDY_TOKENS, "temperature": 0, "json_schema": SCHEMA}
    sse = rest.post("/v1/generate", json={**body, "stream": True})
    assert "".join(e["token"] for e in parse_sse(sse.content)) == rest.post("/v1/generate", json=body).json()["text"]
    responses: queue.Queue = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        grpc_client.async_stream_infer("gpt", [grpc_text_input("PROMPT", [PROMPT])], request_id="s",
                                       parameters={"max_new_tokens": GREEDY_TOKENS, "temperature": 0,
                                                   "json_schema": json.dumps(SCHEMA)})
        streamed = []
        while True:
            result, error = responses.get(timeout=STREAM_WAIT_S)
            assert error is None, error
            streamed.append(result.as_numpy("TEXT")[0].decode())
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        grpc_client.stop_stream()
    assert "".join(streamed) == _grpc(grpc_client, {"json_schema": json.dumps(SCHEMA)})


def test_sampling_stops_and_logprobs_pass_through(client):
    sampled = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=11, n=3,
                                        extra_body={"guided_regex": REGEX})
    assert all(re.fullmatch(REGEX, c.text) for c in sampled.choices), [c.text for c in sampled.choices]
    stopped = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=20, temperature=0, stop=[" "],
                                        extra_body={"guided_choice": CHOICES})
    assert stopped.choices[0].text in ("to", "not") and stopped.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=GREEDY_TOKENS, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"guided_json": SCHEMA})
    choice = chat.choices[0]
    Reply.model_validate_json(choice.message.content)
    assert "".join(t.token for t in choice.logprobs.content) == choice.message.content
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


# --- what is refused, on every API -----------------------------------------------------------------------------

# chat: OpenAI's response_format for a schema, vLLM's guided_* for the others; completions: structured_outputs
CHAT_FIELDS = {"json_schema": "guided_json", "regex": "guided_regex", "grammar": "guided_grammar",
               "choice": "guided_choice"}
VLLM_KEYS = {"json_schema": "json", "regex": "regex", "grammar": "grammar", "choice": "choice"}


def _refusal(client, rest, grpc_client, api: str, sent: dict[str, object]) -> str:
    """The 400 of a request that sends `sent` (native field -> value) through `api`: its message, which is checked
    to name the field as that API calls it (OpenAI: `param`, too)."""
    if api.startswith("chat") or api == "completions":
        if api.startswith("chat"):
            extra = {CHAT_FIELDS[kind]: value for kind, value in sent.items()}
            if "json_schema" in sent:
                extra.pop("guided_json")
                extra["response_format"] = {"type": "json_schema",
                                            "json_schema": {"name": "r", "schema": sent["json_schema"]}}
            call = lambda: client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=8,  # noqa: E731
                                                          stream=api == "chat-stream", extra_body=extra)
            names = ["response_format.json_schema.schema" if k == "json_schema" else CHAT_FIELDS[k] for k in sent]
        else:
            extra = {"structured_outputs": {VLLM_KEYS[kind]: value for kind, value in sent.items()}}
            call = lambda: client.completions.create(model="gpt", prompt=PROMPT, max_tokens=8,  # noqa: E731
                                                     extra_body=extra)
            names = [f"structured_outputs.{VLLM_KEYS[k]}" for k in sent]
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        body = refused.value.body
        assert body["param"] == ", ".join(names)
        assert all(name in body["message"] for name in names)
        return body["message"]
    if api.startswith("native"):
        answer = rest.post("/v1/generate", json={"prompt": PROMPT, "max_new_tokens": 8, "stream": api == "native-stream",
                                                 **sent})
        assert answer.status_code == 400, answer.text  # before any stream starts: never an error event
        message, names = answer.json()["error"]["message"], list(sent)
    elif api == "oip":
        answer = _oip(rest, {kind: _oip_value(kind, value) for kind, value in sent.items()})
        assert answer.status_code == 400, answer.text
        message, names = answer.json()["error"], [f"parameters.{kind}" for kind in sent]
    else:
        with pytest.raises(InferenceServerException) as refused:
            _grpc(grpc_client, {kind: _oip_value(kind, value) for kind, value in sent.items()})
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        message, names = refused.value.message(), [f"parameters.{kind}" for kind in sent]
    assert message.startswith(" and ".join(names) + ":"), message
    return message


APIS = ["chat", "chat-stream", "completions", "native", "native-stream", "oip", "grpc"]


@pytest.mark.parametrize("api", APIS)
def test_a_constraint_that_cannot_compile_is_a_400_naming_the_field(client, rest, grpc_client, api):
    for kind, value in BAD:
        message = _refusal(client, rest, grpc_client, api, {kind: value})
        reason = {"regex": "unclosed group", "grammar": "expecting rule", "choice": "non-empty strings"}.get(kind)
        assert reason is None or reason in message, message
    assert "Unknown format: bogus" in _refusal(client, rest, grpc_client, api, dict(BAD[:1]))


@pytest.mark.parametrize("api", APIS)
def test_two_constraints_are_a_400_naming_both(client, rest, grpc_client, api):
    message = _refusal(client, rest, grpc_client, api, {"json_schema": SCHEMA, "regex": REGEX})
    assert "at most one output constraint" in message


def test_beam_search_under_a_constraint_names_fields_the_client_sent(client, rest):
    native = rest.post("/v1/generate", json={"prompt": PROMPT, "max_new_tokens": 8, "num_beams": 2,
                                             "regex": REGEX}).json()["error"]
    assert "num_beams" in native["message"] and "regex" in native["message"]
    oip = _oip(rest, {"num_beams": 2, "regex": REGEX})
    assert oip.status_code == 400 and "num_beams" in oip.json()["error"] and "regex" in oip.json()["error"]
    with pytest.raises(openai.BadRequestError) as beams:
        client.completions.create(model="gpt", prompt=PROMPT, best_of=2, temperature=0,
                                  extra_body={"guided_regex": REGEX})
    assert beams.value.body["param"] == "best_of" and "guided_regex" in beams.value.body["message"]


def test_a_response_format_of_the_wrong_shape_is_a_400_naming_where(client):
    for form, param in [({"type": "json_schema", "json_schema": {"name": "r", "schema": "{}"}},
                         "response_format.json_schema.schema"),
                        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
                        ({"type": "json_schema", "json_schema": {"name": "r", "strict": "yes"}},
                         "response_format.json_schema.strict"),
                        ({"type": "json_schema"}, "response_format.json_schema"),
                        ({"type": "grammar"}, "response_format")]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=8, response_format=form)
        assert refused.value.body["param"] == param, refused.value.body


# --- observed --------------------------------------------------------------------------------------------------


def test_constrained_requests_count_by_kind_and_the_compiled_cache_hits(client, rest):
    schema = {**SCHEMA, "description": f"unique {uuid.uuid4().hex}"}  # compiled by no test before
    labels = {"model": "gpt"}
    before = scrape(rest)
    for _ in range(2):
        rest.post("/v1/generate", json={"prompt": PROMPT, "max_new_tokens": GREEDY_TOKENS, "temperature": 0,
                                        "json_schema": schema}).raise_for_status()
    client.completions.create(model="gpt", prompt=PROMPT, max_tokens=8, extra_body={"guided_regex": REGEX})
    after = scrape(rest)

    def grew(name: str, **more) -> float:
        return metric(after, name, **labels, **more) - metric(before, name, **labels, **more)

    assert grew("tserve_constrained_requests_total", kind="json_schema") == 2
    assert grew("tserve_constrained_requests_total", kind="regex") == 1
    assert grew("tserve_constraint_cache_total", result="miss") + grew("tserve_constraint_cache_total",
                                                                       result="hit") == 3
    assert grew("tserve_constraint_cache_total", result="hit") >= 1  # the schema's second time
    assert grew("tserve_constraint_compile_seconds_count", kind="json_schema") == 1  # compiled once
    assert np.isfinite(metric(after, "tserve_constraint_compile_seconds_sum", **labels))
