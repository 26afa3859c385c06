"""Each API's request -> serving parameters mapping, without a server: the native requests' `to_params`, the OpenAI
requests' `to_params` (OpenAI's defaults for what is left out, `best_of` at temperature 0 as a beam search, the end of
a chat turn as a stop string, vLLM's extensions as the native options), what the OpenAI requests refuse and ignore
(`check_fields`), each API's output constraint (one, named by the field it came from), and the Open Inference
Protocol's parameter checks and `validated_options` (a native request model behind a 400 that names the field).

Table-style: one request in, the exact parameters out, so a field mapped to the wrong parameter, a lost default or a
default where the caller gave a value shows up as a difference.
"""

from __future__ import annotations

import json

import pytest

from service.api.native.protocol import DEFAULT_GENERATE_TOKENS, DEFAULT_NUM_BEAMS, request_models
from service.api.oip.protocol import boolean_parameter, integer_parameter, validated_options
from service.api.openai import chat_template
from service.api.openai.protocol import DEFAULT_COMPLETION_TOKENS, openai_request_models
from service.errors import BadInput
from service.serving.generate import GenerationParams
from service.serving.translate import TranslationParams
from service.settings import Settings
from tests.support.openai_fields import IGNORED, NO_OP, REFUSED


# Built per test (a few ms): each test then exercises the request models it checks (mutation testing maps a test
# to the functions it calls).
@pytest.fixture
def native():
    return request_models(Settings(max_new_tokens=64, max_num_beams=6))


@pytest.fixture
def openai():
    return openai_request_models(Settings(max_new_tokens=64, max_num_beams=6))


# --- native ----------------------------------------------------------------------------------------------------------

def test_translate_request_maps_every_option(native):
    body = native.translate(text="Ein Hund.", num_beams=5, length_penalty=0.6, early_stopping="never",
                            num_return_sequences=3, max_new_tokens=12, min_new_tokens=2, no_repeat_ngram_size=3,
                            target_prefix="A dog")
    assert body.to_params() == TranslationParams(
        num_beams=5, length_penalty=0.6, early_stopping="never", num_return_sequences=3, max_new_tokens=12,
        min_new_tokens=2, no_repeat_ngram_size=3, target_prefix="A dog")
    assert native.translate(text="Ein Hund.", target_prefix="").to_params().target_prefix is None  # "" = none


def test_translate_request_defaults(native):
    """Left out: the default beam width, the model's length penalty, no length limits beyond the model's own."""
    assert native.translate(text="Ein Hund.").to_params() == TranslationParams(
        num_beams=DEFAULT_NUM_BEAMS, length_penalty=None, early_stopping=False, num_return_sequences=1,
        max_new_tokens=None, min_new_tokens=0, no_repeat_ngram_size=0)


def test_translate_default_beams_within_the_servers_limit():
    narrow = request_models(Settings(max_num_beams=2))
    assert narrow.translate(text="Ein Hund.").to_params().num_beams == 2


def test_generate_request_maps_every_option(native):
    body = native.generate(prompt="ROMEO:", max_new_tokens=20, min_new_tokens=3, temperature=0.7, top_k=40, top_p=0.9,
                           repetition_penalty=1.2, no_repeat_ngram_size=2, seed=11, stop=["\n", "END"], num_beams=1)
    assert body.to_params() == GenerationParams(
        max_new_tokens=20, min_new_tokens=3, temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.2,
        no_repeat_ngram_size=2, seed=11, stop=("\n", "END"), num_beams=1)


def test_generate_request_beams_and_defaults(native):
    params = native.generate(prompt="ROMEO:", num_beams=4).to_params()
    assert params == GenerationParams(max_new_tokens=min(DEFAULT_GENERATE_TOKENS, 64), num_beams=4)
    assert params.stop == () and params.seed is None


# --- OpenAI ----------------------------------------------------------------------------------------------------------

def test_completion_defaults_are_openais(openai):
    params = openai.completion(model="gpt", prompt="ROMEO:").to_params()
    assert params == GenerationParams(max_new_tokens=DEFAULT_COMPLETION_TOKENS, temperature=1.0, top_p=1.0,
                                      presence_penalty=0.0, frequency_penalty=0.0, seed=None, stop=(), num_beams=1,
                                      logprobs=None)


def test_completion_maps_every_option(openai):
    body = openai.completion(model="gpt", prompt="ROMEO:", max_tokens=9, temperature=0.4, top_p=0.8,
                             presence_penalty=0.5, frequency_penalty=-0.25, seed=5, stop="\n", logprobs=3)
    assert body.to_params() == GenerationParams(max_new_tokens=9, temperature=0.4, top_p=0.8, presence_penalty=0.5,
                                                frequency_penalty=-0.25, seed=5, stop=("\n",), num_beams=1,
                                                logprobs=3)


def test_completion_zero_values_are_kept_not_defaulted(openai):
    """temperature 0 is greedy decoding (not OpenAI's default 1); logprobs 0 asks for the chosen tokens' only."""
    params = openai.completion(model="gpt", prompt="x", temperature=0, logprobs=0, stop=["a", "b"]).to_params()
    assert (params.temperature, params.logprobs, params.stop) == (0, 0, ("a", "b"))
    assert params.mode == "greedy"


@pytest.mark.parametrize("best_of, temperature, beams", [
    (3, 0, 3),      # best_of at temperature 0: a beam search of that width
    (3, 0.7, 1),    # sampled: best_of choices are sampled, no beams
    (1, 0, 1),      # one choice: greedy
    (None, 0, 1),
])
def test_best_of_is_a_beam_search_only_at_temperature_zero(openai, best_of, temperature, beams):
    body = openai.completion(model="gpt", prompt="x", temperature=temperature, best_of=best_of)
    assert body.beam_search == (beams > 1)
    assert body.to_params().num_beams == beams


def test_chat_ends_at_the_end_of_a_turn(openai):
    body = openai.chat(model="gpt", messages=[{"role": "user", "content": "Hi"}], stop=["THE END"], seed=2)
    assert body.to_params(max_tokens=30) == GenerationParams(
        max_new_tokens=30, temperature=1.0, top_p=1.0, seed=2, stop=("THE END", chat_template.END_OF_TURN),
        logprobs=None)


@pytest.mark.parametrize("logprobs, top_logprobs, expected", [
    (True, 4, 4), (True, None, 0), (False, 4, None), (None, None, None)])
def test_chat_logprobs(openai, logprobs, top_logprobs, expected):
    body = openai.chat(model="gpt", messages=[{"role": "user", "content": "Hi"}], logprobs=logprobs,
                       top_logprobs=top_logprobs)
    assert body.to_params(max_tokens=5).logprobs == expected


@pytest.mark.parametrize("fields, expected", [
    ({"max_completion_tokens": 7, "max_tokens": 9}, 7), ({"max_tokens": 9}, 9), ({}, None)])
def test_chat_requested_tokens_prefers_max_completion_tokens(openai, fields, expected):
    assert openai.chat(model="gpt", messages=[{"role": "user", "content": "Hi"}], **fields).requested_tokens == expected


@pytest.mark.parametrize("options, expected", [
    ({}, False), ({"stream_options": {"include_usage": True}}, True),
    ({"stream_options": {"include_usage": False}}, False), ({"stream_options": {}}, False)])
def test_include_usage(openai, options, expected):
    assert openai.completion(model="gpt", prompt="x", stream=True, **options).include_usage() is expected


@pytest.mark.parametrize("kind, fields, param, message", [
    ("completion", {"logit_bias": {"50": 10}}, "logit_bias",
     "logit_bias is not supported (only {}: the sampler biases no token)"),
    ("completion", {"suffix": "end"}, "suffix",
     "suffix is not supported (the model has no fill-in-the-middle training)"),
    ("chat", {"tools": [{"type": "function"}]}, "tools", "tools are not supported (the model calls no tools)"),
    ("chat", {"tool_choice": "required"}, "tool_choice",
     'tool_choice: the model calls no tools (only "none" or "auto")'),
    ("chat", {"structured_outputs": {"regex": "a", "disable_additional_properties": True}},
     "structured_outputs.disable_additional_properties",
     'disable_additional_properties is not supported (a schema\'s own "additionalProperties": false is honoured)'),
    ("completion", {"structured_outputs": {"json_object": True, "structural_tag": "{}"}},
     "structured_outputs.structural_tag", "structural_tag is not supported (the model calls no tools)"),
    ("chat", {"modalities": ["audio"]}, "modalities", 'modalities: only ["text"] is supported (no audio output)'),
    ("chat", {"audio": {"voice": "alloy"}}, "audio", "audio output is not supported (the model writes text)"),
    ("chat", {"web_search_options": {}}, "web_search_options", "web_search_options: web search is not supported"),
    ("chat", {"store": True, "tools": [{"type": "function"}]}, "tools",
     "tools are not supported (the model calls no tools)"),  # a refused field wins over ignored ones
])
def test_unsupported_options_are_a_400_naming_the_field(openai, kind, fields, param, message):
    """The client reads which field and why in OpenAI's error object (`param`, `message`)."""
    base = {"prompt": "x"} if kind == "completion" else {"messages": [{"role": "user", "content": "Hi"}]}
    body = getattr(openai, kind)(model="gpt", **base, **fields)
    with pytest.raises(BadInput) as raised:
        body.check_fields()
    assert (raised.value.param, raised.value.message, raised.value.status) == (param, message, 400)


@pytest.mark.parametrize("kind, fields, ignored", [
    ("completion", {"logit_bias": {}, "suffix": None}, []),
    ("chat", {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}}, []),
    ("chat", {"tool_choice": None, "function_call": "auto", "web_search_options": None}, []),
    ("chat", {"modalities": ["text"], "audio": None}, ["audio", "modalities"]),
    ("chat", {"store": True, "metadata": {"k": "v"}, "user": "u"}, ["user", "metadata", "store"]),
    ("completion", {"user": "u", "stream_options": {"include_obfuscation": True, "include_usage": True}},
     ["stream_options.include_obfuscation", "user"]),
    ("chat", {"stream_options": {"include_usage": True}}, []),
    ("chat", {"top_k": 3, "min_tokens": 1, "ignore_eos": False, "repetition_penalty": 1.1}, []),
    ("chat", {"response_format": {"type": "json_object"}, "guided_decoding_backend": "guidance"},
     ["guided_decoding_backend"]),
    ("completion", {"structured_outputs": {"regex": "a", "whitespace_pattern": " ", "disable_fallback": True,
                                           "disable_any_whitespace": True, "disable_additional_properties": False}},
     ["structured_outputs.disable_fallback", "structured_outputs.whitespace_pattern"]),
])
def test_no_op_values_are_accepted_and_ignored_fields_listed(openai, kind, fields, ignored):
    """What `check_fields` returns is what X-Ignored-Fields names: the ignored fields sent, in the table's order."""
    base = {"prompt": "x"} if kind == "completion" else {"messages": [{"role": "user", "content": "Hi"}]}
    assert getattr(openai, kind)(model="gpt", **base, **fields).check_fields() == ignored


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_vllm_extensions_map_to_the_native_options(openai, kind):
    """top_k, min_tokens and repetition_penalty are the native top_k, min_new_tokens and repetition_penalty;
    ignore_eos blocks the end of text for every token; top_k -1 is vLLM's off (0)."""
    base = {"prompt": "x"} if kind == "completion" else {"messages": [{"role": "user", "content": "Hi"}]}
    body = getattr(openai, kind)(model="gpt", **base, max_tokens=10, top_k=7, min_tokens=3, repetition_penalty=1.3)
    params = body.to_params() if kind == "completion" else body.to_params(10)
    assert (params.top_k, params.min_new_tokens, params.repetition_penalty) == (7, 3, 1.3)
    eos = getattr(openai, kind)(model="gpt", **base, max_tokens=10, ignore_eos=True, top_k=-1)
    params = eos.to_params() if kind == "completion" else eos.to_params(10)
    assert (params.top_k, params.min_new_tokens, params.max_new_tokens, params.repetition_penalty) == (0, 10, 10, 1.0)


@pytest.mark.parametrize("fields, message", [
    ({"max_tokens": 4, "min_tokens": 5}, "min_tokens (5) must be <= max_tokens (4)"),
    ({"min_tokens": 17}, "min_tokens (17) must be <= max_tokens (16)"),  # OpenAI's default max_tokens
])
def test_min_tokens_above_max_tokens_is_a_400_in_openais_names(openai, fields, message):
    with pytest.raises(BadInput) as raised:
        openai.completion(model="gpt", prompt="x", **fields).to_params()
    assert (raised.value.param, raised.value.message) == ("min_tokens", message)


@pytest.mark.parametrize("fields, budget", [
    ({"max_completion_tokens": 7, "max_tokens": 9}, (7, "max_completion_tokens")),
    ({"max_tokens": 9}, (9, "max_tokens")),
    ({"max_tokens": 9, "min_tokens": 12}, (9, "max_tokens")),
    ({"min_tokens": 12}, (12, "min_tokens")),
    ({}, (1, "max_tokens")),
])
def test_chat_token_budget_names_the_field_that_asks_for_it(openai, fields, budget):
    """The tokens a chat prompt must leave room for, and the field a context error names."""
    assert openai.chat(model="gpt", messages=[{"role": "user", "content": "Hi"}], **fields).token_budget() == budget


def test_chat_min_tokens_error_names_max_completion_tokens(openai):
    body = openai.chat(model="gpt", messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=3,
                       min_tokens=4)
    with pytest.raises(BadInput, match=r"^min_tokens \(4\) must be <= max_completion_tokens \(3\)$"):
        body.to_params(3)


@pytest.mark.parametrize("stop, expected", [(None, []), ("\n", ["\n"]), ("END", ["END"]), (["a", "b"], ["a", "b"])])
def test_stops_as_a_list(openai, stop, expected):
    assert openai.completion(model="gpt", prompt="x", stop=stop).stops() == expected


# --- Open Inference Protocol -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [True, False, 2.0, "3", None, 0])
def test_integer_parameter_rejects_non_integers_and_small_values(value):
    with pytest.raises(BadInput, match=r"^parameters\.timeout must be an integer >= 1, got "):
        integer_parameter(value, "parameters.timeout", 1)


@pytest.mark.parametrize("value, minimum", [(1, 1), (5, 1), (0, 0)])
def test_integer_parameter_accepts_integers_from_the_minimum(value, minimum):
    assert integer_parameter(value, "x", minimum) == value


@pytest.mark.parametrize("value", [1, 0, "yes", "true", None])
def test_boolean_parameter_is_true_or_false_only(value):
    with pytest.raises(BadInput, match=r"^binary_data must be true or false, got "):
        boolean_parameter(value, "binary_data")


@pytest.mark.parametrize("value", [True, False])
def test_boolean_parameter_accepts_booleans(value):
    assert boolean_parameter(value, "binary_data") is value


def test_validated_options_map_as_a_native_request(native):
    body = validated_options(native.generate, {"prompt": "ROMEO:", "max_new_tokens": 5, "seed": 1}, "PROMPT[0]")
    assert body.to_params() == GenerationParams(max_new_tokens=5, seed=1)


def test_validated_options_are_a_400_naming_what_and_the_field(native):
    with pytest.raises(BadInput, match=r"^parameters: .*num_beams") as raised:
        validated_options(native.translate, {"text": "Ein Hund.", "num_beams": 7}, "parameters")
    assert raised.value.status == 400


# --- OpenAI completions: prompt scoring (echo + logprobs, prompt_logprobs, max_tokens 0) ------------------------------

@pytest.mark.parametrize(("fields", "prompt_logprobs", "max_new_tokens"), [
    ({}, None, DEFAULT_COMPLETION_TOKENS),
    ({"echo": True}, None, DEFAULT_COMPLETION_TOKENS),  # echo alone: the text only, nothing to score
    ({"logprobs": 2}, None, DEFAULT_COMPLETION_TOKENS),  # the generated tokens' only
    ({"echo": True, "logprobs": 2}, 2, DEFAULT_COMPLETION_TOKENS),
    ({"echo": True, "logprobs": 0, "max_tokens": 0}, 0, 0),  # score only: 0 stays 0, not the default
    ({"prompt_logprobs": 3}, 3, DEFAULT_COMPLETION_TOKENS),
    ({"echo": True, "logprobs": 1, "prompt_logprobs": 4}, 4, DEFAULT_COMPLETION_TOKENS),  # the most either asks
    ({"echo": True, "logprobs": 5, "prompt_logprobs": 0, "max_tokens": 1}, 5, 1),
])
def test_completion_scores_the_prompt_when_echo_with_logprobs_or_prompt_logprobs_ask(openai, fields, prompt_logprobs,
                                                                                    max_new_tokens):
    params = openai.completion(model="gpt", prompt="ROMEO:", **fields).to_params()
    assert (params.prompt_logprobs, params.max_new_tokens) == (prompt_logprobs, max_new_tokens)
    assert params.logprobs == fields.get("logprobs")


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": 0}, "max_tokens"),  # nothing to return without echo
    ({"max_tokens": 0, "echo": False}, "max_tokens"),
    ({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"stream": True, "echo": True, "logprobs": 1}, "stream"),
])
def test_completion_prompt_scoring_refusals_name_the_field(openai, fields, param):
    with pytest.raises(BadInput) as refused:
        openai.completion(model="gpt", prompt="ROMEO:", **fields).check_scoring()
    assert refused.value.param == param


@pytest.mark.parametrize("fields", [{"max_tokens": 0, "echo": True}, {"stream": True, "echo": True},
                                    {"stream": True, "logprobs": 2}, {"echo": True, "logprobs": 1}])
def test_completion_prompt_scoring_accepts(openai, fields):
    openai.completion(model="gpt", prompt="ROMEO:", **fields).check_scoring()


BASE = {"completion": {"prompt": "x"}, "chat": {"messages": [{"role": "user", "content": "Hi"}]}}


@pytest.mark.parametrize("kind, field, value", IGNORED)
def test_each_ignored_field_is_listed_alone(openai, kind, field, value):
    assert getattr(openai, kind)(model="gpt", **BASE[kind], **{field: value}).check_fields() == [field]


@pytest.mark.parametrize("kind, field, value", REFUSED)
def test_each_refused_field_is_a_400_naming_it(openai, kind, field, value):
    with pytest.raises(BadInput) as raised:
        getattr(openai, kind)(model="gpt", **BASE[kind], **{field: value}).check_fields()
    assert (raised.value.param, raised.value.status) == (field, 400) and field in raised.value.message


@pytest.mark.parametrize("kind, field, value", NO_OP)
def test_each_no_op_value_is_accepted_and_not_listed(openai, kind, field, value):
    assert getattr(openai, kind)(model="gpt", **BASE[kind], **{field: value}).check_fields() == []


# --- output constraints ---------------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}}


@pytest.mark.parametrize("fields, kind, text, field", [
    ({"response_format": {"type": "text"}}, None, None, None),
    ({"response_format": {"type": "json_object"}}, "json_object", '{"type": "object"}', "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": False}}},
     "json_schema", json.dumps(SCHEMA), "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}}, "json_schema", "{}",
     "response_format.json_schema.schema"),  # no schema: any JSON value
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", json.dumps(SCHEMA),
     "structured_outputs.json"),  # vLLM takes a schema as JSON text too
    ({"structured_outputs": {"regex": "[a-z]+", "json_object": False}}, "regex", "[a-z]+", "structured_outputs.regex"),
    ({"structured_outputs": {"json_object": True}}, "json_object", '{"type": "object"}',
     "structured_outputs.json_object"),
    ({"guided_json": SCHEMA}, "json_schema", json.dumps(SCHEMA), "guided_json"),
    ({"guided_choice": ["a", "b"]}, "choice", '["a", "b"]', "guided_choice"),
    ({"guided_grammar": 'start: "a"', "guided_decoding_backend": "xgrammar"}, "grammar", 'start: "a"',
     "guided_grammar"),
])
def test_openai_structured_outputs_map_to_one_constraint(openai, fields, kind, text, field):
    for request in (openai.completion(model="gpt", prompt="x", **fields),
                    openai.chat(model="gpt", messages=[{"role": "user", "content": "Hi"}], **fields)):
        constraint = (request.to_params(8) if isinstance(request, openai.chat) else request.to_params()).constraint
        assert (None if constraint is None else (constraint.kind, constraint.text, constraint.field)) == (
            None if kind is None else (kind, text, field))


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format, guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.regex, structured_outputs.choice"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),  # none
    ({"structured_outputs": {"json": "{x"}}, "structured_outputs.json"),  # not JSON
    ({"guided_json": "[1]"}, "guided_json"),  # not a schema
    ({"guided_choice": []}, "guided_choice"),
    ({"best_of": 2, "temperature": 0, "guided_regex": "a"}, "best_of"),  # a beam search: no constraint
])
def test_openai_structured_outputs_refused_name_the_fields(openai, fields, param):
    with pytest.raises(BadInput) as raised:
        openai.completion(model="gpt", prompt="x", **fields).to_params()
    assert raised.value.param == param and all(name in raised.value.message for name in param.split(", "))


def test_native_constraint_fields_and_their_names_in_each_api(native):
    body = native.generate(prompt="x", regex="[a-z]+")
    assert (body.to_params().constraint.field, body.to_params("parameters.").constraint.field) == (
        "regex", "parameters.regex")
    with pytest.raises(BadInput) as two:
        native.generate(prompt="x", json_schema=SCHEMA, choice=["a"]).to_params("parameters.")
    assert two.value.message.startswith("parameters.json_schema and parameters.choice: at most one")
