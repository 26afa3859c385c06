"""Every request field of the OpenAI-compatible API has a rule (`service.api.openai.field_rules`): the installed
`openai` SDK's own request types are enumerated, so a field a new SDK version adds fails here until it is
classified; the rules table, the request schemas and docs/openai-fields.md agree; and, through the real SDK
against a real server on the tiny GPT, each ignored field is accepted and named in X-Ignored-Fields, each refused
one is a 400 naming it, vLLM's extensions (`extra_body`) do what the native options do, and the context error
names the field of the API that was called (OpenAI's `max_tokens` / `max_completion_tokens`, the native
`max_new_tokens`, the Open Inference Protocol's `parameters.max_new_tokens`).
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from openai.types.chat.chat_completion_stream_options_param import ChatCompletionStreamOptionsParam

from service.api.openai import field_rules
from service.api.openai.protocol import StreamOptions, openai_request_models
from service.api.openai.structured import StructuredOutputs
from service.settings import Settings
from tests.support.openai_fields import IGNORED, NO_OP, REFUSED

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai-fields.md"
PROMPT = "ROMEO:\n"
MESSAGES = [{"role": "user", "content": "Good morrow."}]
TABLES = {"completion": field_rules.COMPLETION, "chat": field_rules.CHAT}
SDK_TYPES = {"completion": completion_params, "chat": chat_params}
HEADINGS = {"completion": "## `POST /v1/completions`", "chat": "## `POST /v1/chat/completions`"}


def sdk_fields(module) -> set[str]:
    """The request fields of one endpoint as the installed SDK types them (`stream` is in the streaming and
    non-streaming variants only), the fields of `stream_options` as "stream_options.<field>"."""
    types = (module.CompletionCreateParamsBase, module.CompletionCreateParamsStreaming,
             module.CompletionCreateParamsNonStreaming)
    fields = set().union(*(t.__required_keys__ | t.__optional_keys__ for t in types))
    options = ChatCompletionStreamOptionsParam.__required_keys__ | ChatCompletionStreamOptionsParam.__optional_keys__
    return fields | {f"stream_options{field_rules.NESTED}{name}" for name in options}


def official(table, kind: str) -> set[str]:
    extensions = field_rules.EXTENSION_FIELDS[kind]
    return {name for name in table if name.partition(field_rules.NESTED)[0] not in extensions}


# --- the rules against the SDK, the schemas and the docs (no server) ----------------------------------------------


@pytest.mark.parametrize("kind", TABLES)
def test_every_field_of_the_installed_sdk_has_a_rule(kind):
    fields = sdk_fields(SDK_TYPES[kind])
    assert "model" in fields and "stream" in fields and len(fields) > 10  # the enumeration reads the real types
    missing = fields - official(TABLES[kind], kind)
    assert not missing, (f"openai {openai.__version__} sends {sorted(missing)} to the {kind} endpoint: give each a "
                         "rule in service/api/openai/field_rules.py, a schema field and a row in docs/openai-fields.md")
    assert not official(TABLES[kind], kind) - fields, \
        "a rule for a field the SDK does not have (a typo, or a removed one)"


@pytest.mark.parametrize("kind", TABLES)
def test_the_schema_takes_exactly_the_fields_that_have_rules(kind):
    model = getattr(openai_request_models(Settings()), kind)
    top = {name for name in TABLES[kind] if field_rules.NESTED not in name}
    assert set(model.model_fields) == top
    for parent, schema in (("stream_options", StreamOptions), ("structured_outputs", StructuredOutputs)):
        nested = {name.partition(field_rules.NESTED)[2] for name in TABLES[kind] if name.startswith(f"{parent}.")}
        assert {field.alias or name for name, field in schema.model_fields.items()} == nested


def _doc_rows(kind: str) -> dict[str, tuple[str, str, bool]]:
    """field -> (rule, note, marked as vLLM's) from the endpoint's table in docs/openai-fields.md."""
    section = DOC.read_text().split(HEADINGS[kind], 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([\w.]+)`( \(vLLM\))? \| ([^|]+) \| (.+) \|$", section, re.MULTILINE)
    return {name: (rule, note, bool(mark)) for name, mark, rule, note in rows}


@pytest.mark.parametrize("kind", TABLES)
def test_the_docs_table_is_the_rules_table(kind):
    extensions = field_rules.EXTENSION_FIELDS[kind]
    expected = {name: (rule.rule, rule.note, name.partition(field_rules.NESTED)[0] in extensions)
                for name, rule in TABLES[kind].items()}
    assert _doc_rows(kind) == expected


# --- through the real SDK ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(server_factory):
    with server_factory("openai fields server", models='["gpt"]', max_new_tokens=60) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _create(client, kind: str, **fields):
    """The raw response (headers and the parsed object) of a short greedy request to `kind`; vLLM's fields in
    `extra_body`, as the SDK takes them."""
    extra = {name: value for name, value in fields.items() if name in field_rules.EXTENSION_FIELDS[kind]}
    fields = {name: value for name, value in fields.items() if name not in extra}
    if kind == "completion":
        return client.completions.with_raw_response.create(model="gpt", prompt=PROMPT, max_tokens=4, temperature=0,
                                                           extra_body=extra or None, **fields)
    return client.chat.completions.with_raw_response.create(model="gpt", messages=MESSAGES, max_tokens=4,
                                                            temperature=0, extra_body=extra or None, **fields)


@pytest.mark.slow
@pytest.mark.parametrize("kind, field, value", IGNORED)
def test_an_ignored_field_is_accepted_and_named_in_the_header(client, kind, field, value):
    assert TABLES[kind][field].of(value) == field_rules.IGNORED
    raw = _create(client, kind, **{field: value})
    assert raw.headers[field_rules.IGNORED_FIELDS_HEADER] == field
    plain = _create(client, kind)
    assert field_rules.IGNORED_FIELDS_HEADER not in plain.headers
    assert _text(raw.parse()) == _text(plain.parse())  # ignored: the same greedy text as without it


def _text(result) -> str:
    choice = result.choices[0]
    return choice.text if hasattr(choice, "text") else choice.message.content


@pytest.mark.slow
def test_several_ignored_fields_are_named_in_the_tables_order_and_streams_carry_the_header(client):
    raw = _create(client, "chat", store=False, metadata={"a": "b"}, user="u", reasoning_effort="low")
    assert raw.headers[field_rules.IGNORED_FIELDS_HEADER] == "user, reasoning_effort, metadata, store"
    for kind in TABLES:
        create = client.completions if kind == "completion" else client.chat.completions
        base = {"prompt": PROMPT} if kind == "completion" else {"messages": MESSAGES}
        with create.with_streaming_response.create(
                model="gpt", **base, max_tokens=4, temperature=0, stream=True, user="u",
                stream_options={"include_usage": True, "include_obfuscation": False}) as streamed:
            assert streamed.headers[field_rules.IGNORED_FIELDS_HEADER] == \
                "stream_options.include_obfuscation, user"
            chunks = list(streamed.parse())
        assert chunks[-1].usage.completion_tokens == 4  # include_usage, beside it, is honoured


@pytest.mark.slow
@pytest.mark.parametrize("kind, field, value", REFUSED)
def test_a_refused_field_is_a_400_naming_it(client, kind, field, value):
    with pytest.raises(openai.BadRequestError) as refused:
        _create(client, kind, **{field: value})
    body = refused.value.body
    assert body["param"] == field and field in body["message"]
    assert body["type"] == "invalid_request_error"


@pytest.mark.slow
@pytest.mark.parametrize("kind, field, value", NO_OP)
def test_a_value_that_asks_for_nothing_unsupported_is_honoured(client, kind, field, value):
    raw = _create(client, kind, **{field: value})
    assert field_rules.IGNORED_FIELDS_HEADER not in raw.headers and _text(raw.parse())


# --- vLLM's extensions ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_top_k_and_repetition_penalty_do_what_the_native_options_do(client, server):
    greedy = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    top_1 = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=30, temperature=1.0, seed=5,
                                      extra_body={"top_k": 1}).choices[0].text
    sampled = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=30, temperature=1.0, seed=5,
                                        extra_body={"top_k": -1}).choices[0].text
    assert top_1 == greedy != sampled  # top_k 1 samples the most likely token; -1 is vLLM's "off"
    penalised = client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=30, temperature=0,
                                               extra_body={"repetition_penalty": 3.0})
    plain = client.chat.completions.create(model="gpt", messages=MESSAGES, max_tokens=30, temperature=0)
    assert penalised.choices[0].message.content != plain.choices[0].message.content
    completion = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=30, temperature=0,
                                           extra_body={"repetition_penalty": 3.0}).choices[0].text
    native = httpx.post(f"{server.url}/v1/generate", json={"prompt": PROMPT, "max_new_tokens": 30, "temperature": 0,
                                                            "repetition_penalty": 3.0}).json()
    assert completion == native["text"] != greedy


@pytest.mark.slow
def test_min_tokens_and_ignore_eos_are_the_native_min_new_tokens(client, server):
    options = {"prompt": PROMPT, "max_new_tokens": 20, "temperature": 1.0, "seed": 2}
    for extension, min_new_tokens in (({"min_tokens": 12}, 12), ({"ignore_eos": True}, 20)):
        result = client.completions.create(model="gpt", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=2,
                                           extra_body=extension)
        native = httpx.post(f"{server.url}/v1/generate", json={**options, "min_new_tokens": min_new_tokens}).json()
        assert result.choices[0].text == native["text"]
        assert result.usage.completion_tokens >= min_new_tokens
    with pytest.raises(openai.BadRequestError) as too_many:
        client.chat.completions.create(model="gpt", messages=MESSAGES, max_completion_tokens=5,
                                       extra_body={"min_tokens": 9})
    assert too_many.value.body["param"] == "min_tokens"
    assert too_many.value.body["message"] == "min_tokens (9) must be <= max_completion_tokens (5)"
    with pytest.raises(openai.BadRequestError) as invalid:
        client.completions.create(model="gpt", prompt=PROMPT, extra_body={"ignore_eos": 1})
    assert invalid.value.body["param"] == "ignore_eos"


# --- errors name the field of the API that was called -----------------------------------------------------------

LONG_PROMPT = "x" * 60  # 60 byte-level tokens of the tiny GPT's 64


@pytest.mark.slow
@pytest.mark.parametrize("kind, fields, param", [
    ("completion", {"max_tokens": 20}, "max_tokens"),
    ("completion", {}, "max_tokens"),  # the default 16 does not fit either: named as the field that sets it
    ("chat", {"max_tokens": 40}, "max_tokens"),
    ("chat", {"max_completion_tokens": 40}, "max_completion_tokens"),
    ("chat", {"max_completion_tokens": 40, "max_tokens": 2}, "max_completion_tokens"),
])
def test_the_context_error_names_the_openai_field(client, kind, fields, param):
    with pytest.raises(openai.BadRequestError) as too_long:
        if kind == "completion":
            client.completions.create(model="gpt", prompt=LONG_PROMPT, **fields)
        else:
            client.chat.completions.create(model="gpt", messages=[{"role": "user", "content": LONG_PROMPT}],
                                           **fields)
    body = too_long.value.body
    assert body["param"] == param
    assert re.fullmatch(rf"prompt \(\d+ tokens\) \+ {param} \(\d+\) exceeds the model's context of 64 tokens",
                        body["message"]), body["message"]


@pytest.mark.slow
def test_the_context_error_names_each_apis_own_field(server):
    native = httpx.post(f"{server.url}/v1/generate", json={"prompt": LONG_PROMPT, "max_new_tokens": 20})
    assert native.status_code == 400
    assert native.json()["error"]["message"] == ("prompt (60 tokens) + max_new_tokens (20) exceeds the model's "
                                                 "context of 64 tokens")
    oip = httpx.post(f"{server.url}/v2/models/gpt/infer", json={
        "inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": [LONG_PROMPT]}],
        "parameters": {"max_new_tokens": 20}})
    assert oip.status_code == 400
    assert oip.json()["error"] == ("prompt (60 tokens) + parameters.max_new_tokens (20) exceeds the model's "
                                   "context of 64 tokens")
