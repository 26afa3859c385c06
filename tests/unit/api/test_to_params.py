"""Each API's request -> serving parameters mapping, without a server: the native requests' `to_params`, the OpenAI
requests' `to_params` (OpenAI's defaults for what is left out, `best_of` at temperature 0 as a beam search, the end of
a chat turn as a stop string), what the OpenAI requests refuse (`check_supported`), and the Open Inference Protocol's
parameter checks and `validated_options` (a native request model behind a 400 that names the field).

Table-style: one request in, the exact parameters out, so a field mapped to the wrong parameter, a lost default or a
default where the caller gave a value shows up as a difference.
"""

from __future__ import annotations

import pytest

from service.api.native.protocol import DEFAULT_GENERATE_TOKENS, DEFAULT_NUM_BEAMS, request_models
from service.api.oip.protocol import boolean_parameter, integer_parameter, validated_options
from service.api.openai import chat_template
from service.api.openai.protocol import DEFAULT_COMPLETION_TOKENS, openai_request_models
from service.errors import BadInput
from service.serving.generate import GenerationParams
from service.serving.translate import TranslationParams
from service.settings import Settings


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
                            num_return_sequences=3, max_new_tokens=12, min_new_tokens=2, no_repeat_ngram_size=3)
    assert body.to_params() == TranslationParams(
        num_beams=5, length_penalty=0.6, early_stopping="never", num_return_sequences=3, max_new_tokens=12,
        min_new_tokens=2, no_repeat_ngram_size=3)


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
    ("completion", {"logit_bias": {"50": 10}}, "logit_bias", "logit_bias is not supported"),
    ("completion", {"suffix": "end"}, "suffix",
     "suffix is not supported (the model has no fill-in-the-middle training)"),
    ("chat", {"tools": [{"type": "function"}]}, "tools", "tools are not supported"),
    ("chat", {"tool_choice": "auto"}, "tools", "tools are not supported"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format",
     'response_format: only {"type": "text"} is supported'),
])
def test_unsupported_options_are_a_400_naming_the_field(openai, kind, fields, param, message):
    """The client reads which field and why in OpenAI's error object (`param`, `message`)."""
    base = {"prompt": "x"} if kind == "completion" else {"messages": [{"role": "user", "content": "Hi"}]}
    body = getattr(openai, kind)(model="gpt", **base, **fields)
    with pytest.raises(BadInput) as raised:
        body.check_supported()
    assert (raised.value.param, raised.value.message, raised.value.status) == (param, message, 400)


@pytest.mark.parametrize("kind, fields", [
    ("completion", {"logit_bias": {}, "suffix": None}),
    ("chat", {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}}),
    ("chat", {"tool_choice": None}),
])
def test_no_op_values_of_unsupported_options_are_accepted(openai, kind, fields):
    base = {"prompt": "x"} if kind == "completion" else {"messages": [{"role": "user", "content": "Hi"}]}
    getattr(openai, kind)(model="gpt", **base, **fields).check_supported()


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
