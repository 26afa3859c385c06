"""The tokenizer endpoints (`service.api.tokenize`: vLLM's `/tokenize`, `/detokenize`, `/tokenizer_info`) against a
real server on the tiny models: the ids are the served models' own tokenizers' (compared with `tokenizers` reading
the version's tokenizer.json), the shapes are vLLM's, chats are rendered as /v1/chat/completions renders them, bad
input is a 400/404 in OpenAI's error shape naming the field, and lm-eval's own remote tokenizer
(`lm_eval.utils.RemoteTokenizer`, what `tokenizer_backend=remote` uses) works against the server unchanged.
"""

from __future__ import annotations

import httpx
import pytest
from tokenizers import Tokenizer

from service.api.openai import chat_template
from service.settings import Settings

pytestmark = pytest.mark.slow

PROMPT = "ROMEO:\nBut soft, what light?"
GERMAN = "Ein Mann fährt mit dem Fahrrad."
MESSAGES = [{"role": "user", "content": "Good morrow."}, {"role": "assistant", "content": "Good morrow, sir."}]


@pytest.fixture(scope="module")
def server(server_factory):
    with server_factory("tokenize server") as process:  # all three tiny models: the ViT has no tokenizer
        yield process


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizers(tiny_repository):
    return {kind: Tokenizer.from_file(str(tiny_repository / kind / "1" / "tokenizer.json"))
            for kind in ("gpt", "translation")}


@pytest.fixture(scope="module")
def configs(tiny_repository):
    import json

    return {kind: json.loads((tiny_repository / kind / "1" / "config.json").read_text())
            for kind in ("gpt", "translation")}


def _ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def _error(response: httpx.Response, status: int, param: str) -> dict:
    """An error in OpenAI's shape, naming `param`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return error


# --- /tokenize ----------------------------------------------------------------------------------------------------


def test_tokenize_is_the_gpts_tokenizer_in_vllms_shape(http, tokenizers, configs):
    body = _ok(http.post("/tokenize", json={"model": "gpt", "prompt": PROMPT}))
    ids = tokenizers["gpt"].encode(PROMPT).ids
    assert list(body) == ["count", "max_model_len", "tokens", "token_strs"]  # vLLM's TokenizeResponse, in order
    assert body == {"count": len(ids), "max_model_len": configs["gpt"]["context_length"], "tokens": ids,
                    "token_strs": None}
    assert len(ids) == len(PROMPT.encode())  # byte-level: one token per byte of ASCII text


def test_tokenize_without_a_model_is_the_gpt_and_token_strs_are_the_vocabularys(http, tokenizers):
    body = _ok(http.post("/tokenize", json={"prompt": "a b\n", "return_token_strs": True}))
    assert body["tokens"] == tokenizers["gpt"].encode("a b\n").ids
    assert body["token_strs"] == ["a", "Ġ", "b", "Ċ"]  # byte-level BPE's strings, as convert_ids_to_tokens gives


def test_the_end_of_text_token_is_recognised_in_a_prompt(http, configs):
    eos = configs["gpt"]["special_tokens"]["eos_id"]
    assert _ok(http.post("/tokenize", json={"prompt": "<|endoftext|>", "add_special_tokens": False}))["tokens"] == [eos]


def test_the_translator_appends_its_end_of_source_token_with_add_special_tokens(http, tokenizers, configs):
    ids = tokenizers["translation"].encode(GERMAN).ids
    eos = configs["translation"]["special_tokens"]["eos_id"]
    plain = _ok(http.post("/tokenize", json={"model": "translation", "prompt": GERMAN, "add_special_tokens": False}))
    fed = _ok(http.post("/tokenize", json={"model": "translation", "prompt": GERMAN, "return_token_strs": True}))
    assert plain["tokens"] == ids and fed["tokens"] == ids + [eos]
    assert fed["count"] == len(ids) + 1 and fed["max_model_len"] == configs["translation"]["max_source_length"]
    assert fed["token_strs"][-1] == "</s>" and fed["token_strs"][0].startswith("\u2581")  # metaspace's word start


def test_a_chat_is_tokenized_as_the_chat_route_renders_it(http, tokenizers):
    gpt = tokenizers["gpt"]

    class Message:  # what chat_template.render reads
        def __init__(self, role, content):
            self.role, self.content, self.name = role, content, None

    rendered = chat_template.render([Message(m["role"], m["content"]) for m in MESSAGES])
    turn = f"{chat_template.ASSISTANT_SPEAKER}:\n"
    cases = {(): rendered, (("add_generation_prompt", False),): rendered.removesuffix(turn),
             (("add_generation_prompt", False), ("continue_final_message", True)):
                 rendered.removesuffix(chat_template.END_OF_TURN + turn)}
    for options, text in cases.items():
        body = _ok(http.post("/tokenize", json={"messages": MESSAGES, **dict(options)}))
        assert body["tokens"] == gpt.encode(text).ids, options
    assert cases[()].endswith("\n\nJULIET:\n") and cases[(("add_generation_prompt", False),)].endswith("sir.\n\n")


def test_an_empty_prompt_has_no_tokens(http):
    assert _ok(http.post("/tokenize", json={"prompt": ""}))["tokens"] == []


# --- /detokenize --------------------------------------------------------------------------------------------------


def test_detokenize_round_trips_and_keeps_special_tokens(http, tokenizers):
    ids = tokenizers["gpt"].encode(PROMPT).ids
    assert _ok(http.post("/detokenize", json={"model": "gpt", "tokens": ids})) == {"prompt": PROMPT}
    eos = tokenizers["gpt"].token_to_id("<|endoftext|>")
    text = _ok(http.post("/detokenize", json={"tokens": [eos] + ids}))["prompt"]
    assert text == "<|endoftext|>" + PROMPT  # as vLLM: ids -> text -> ids gives the ids back
    assert _ok(http.post("/tokenize", json={"prompt": text}))["tokens"] == [eos] + ids


def test_detokenize_the_translators_ids(http, tokenizers):
    ids = tokenizers["translation"].encode(GERMAN).ids
    assert _ok(http.post("/detokenize", json={"model": "translation", "tokens": ids}))["prompt"] == GERMAN


# --- /tokenizer_info ----------------------------------------------------------------------------------------------


def test_tokenizer_info_states_the_special_tokens(http, configs):
    gpt = _ok(http.get("/tokenizer_info"))
    assert gpt["tokenizer_class"] == "PreTrainedTokenizerFast" and gpt["model"] == "gpt"
    assert gpt["eos_token"] == "<|endoftext|>" and gpt["bos_token"] is None and gpt["pad_token"] is None
    assert gpt["model_max_length"] == configs["gpt"]["context_length"] and gpt["add_eos_token"] is False
    eos = str(configs["gpt"]["special_tokens"]["eos_id"])
    assert gpt["added_tokens_decoder"] == {eos: {"content": "<|endoftext|>", "lstrip": False, "normalized": False,
                                                 "rstrip": False, "single_word": False, "special": True}}
    translator = _ok(http.get("/tokenizer_info", params={"model": "translation"}))
    assert (translator["bos_token"], translator["eos_token"], translator["pad_token"], translator["unk_token"]) == \
        ("<s>", "</s>", "<pad>", "<unk>")
    assert translator["add_eos_token"] is True
    assert translator["model_max_length"] == configs["translation"]["max_source_length"]


# --- the schema ---------------------------------------------------------------------------------------------------


def test_openapi_documents_the_routes_and_their_examples_succeed(http):
    spec = _ok(http.get("/openapi.json"))
    schemas = spec["components"]["schemas"]
    assert "get" in spec["paths"]["/tokenizer_info"]
    for path in ("/tokenize", "/detokenize"):
        operation = spec["paths"][path]["post"]
        assert {"200", "400", "404"} <= set(operation["responses"]), path
        schema = schemas[operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]]
        for example in schema["examples"]:
            assert http.post(path, json=example).status_code == 200, (path, example)
    tokenize = schemas[spec["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
                       ["$ref"].rsplit("/", 1)[1]]
    prompt_limit = [member.get("maxLength") for member in tokenize["properties"]["prompt"]["anyOf"]]
    # the tokenizer routes' own bound (this server: TSERVE_MAX_TOKENIZE_CHARS' default), not the generation prompt's
    assert Settings.model_fields["max_tokenize_chars"].default in prompt_limit


# --- bad input ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "chat_template": "{{ x }}"}, "chat_template"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "beep"}]}, "messages.0.role"),
    ("/tokenize", '{"prompt": "a\\ud800"}', "prompt"),  # a lone surrogate (raw JSON: httpx would not send it)
    ("/detokenize", {"tokens": [1, -1]}, "tokens.1"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens.1"),
    ("/detokenize", {"tokens": [1, 2**70]}, "tokens.1"),
    ("/detokenize", {"tokens": [72, 257]}, "tokens.1"),  # the tiny GPT's vocabulary: 256 bytes and <|endoftext|>
    ("/detokenize", {"model": "translation", "tokens": [5, 8000]}, "tokens.1"),
    ("/detokenize", {"tokens": "72"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_field(http, path, body, param):
    raw = {"json": body} if not isinstance(body, str) else {"content": body,
                                                             "headers": {"content-type": "application/json"}}
    error = _error(http.post(path, **raw), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("call", [
    lambda http: http.post("/tokenize", json={"model": "nope", "prompt": "a"}),
    lambda http: http.post("/tokenize", json={"model": "vit", "prompt": "a"}),
    lambda http: http.post("/detokenize", json={"model": "vit", "tokens": [1]}),
    lambda http: http.get("/tokenizer_info", params={"model": "nope"}),
])
def test_an_unknown_model_or_one_without_a_tokenizer_is_a_404_naming_model(http, call):
    error = _error(call(http), 404, "model")
    assert error["code"] == "not_found"


def test_the_vit_is_named_as_a_model_without_a_tokenizer(http):
    message = _error(http.post("/tokenize", json={"model": "vit", "prompt": "a"}), 404, "model")["message"]
    assert "vit" in message and "no tokenizer" in message


# --- lm-eval's remote tokenizer ----------------------------------------------------------------------------------


def test_lm_evals_remote_tokenizer_works_against_the_server(server, tokenizers, configs):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    base_url = f"{server.url}/v1/completions"  # as lm-eval's local-completions is given it
    assert check_remote_tokenizer_support(base_url)  # what tokenizer_backend=auto probes
    remote = RemoteTokenizer(base_url)
    ids = tokenizers["gpt"].encode(PROMPT).ids
    assert remote.encode(PROMPT) == ids and remote.decode(ids) == PROMPT
    assert remote.batch_decode([ids, ids[:3]]) == [PROMPT, PROMPT[:3]]
    assert remote.eos_token == "<|endoftext|>" and remote.eos_token_id == configs["gpt"]["special_tokens"]["eos_id"]
    assert remote.bos_token_id is None  # so lm-eval's prefix token (rolling windows, empty contexts) is the EOS
