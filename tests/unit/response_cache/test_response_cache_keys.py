"""The response cache's keys and codec (service/response_cache/keys.py, codec.py), without a server: a key changes
with every field of the parameters that take part in their equality and with the version's scope (weights variant,
provider, config), never with a compiled constraint or the priority; an answer reads back exactly (every float,
-inf log-probabilities, tuples, arrays bit for bit) and only as the classes named."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from service.decoding import TokenLogprob
from service.decoding.constraints import Constraint
from service.response_cache.codec import Undecodable, decode, encode
from service.response_cache.keys import canonical, request_key, version_scope
from service.scheduling.jobs import PromptLogprobs
from service.serving.generate import GenerationParams
from service.serving.outputs import Completion
from service.serving.score import Scored, TargetScore
from service.serving.translate import TranslationParams

SCOPE = "0" * 64
VARIANT = {"weights": "int8", "attention": "mha", "kv_cache": "inplace", "kv_residence": "host", "speculation": "off",
           "chosen_by": "measured", "reason": "the fastest"}
CONFIG = {"kind": "gpt", "context_length": 64}

# one changed value per field of each parameters dataclass (every field that takes part in equality)
GENERATION_CHANGES = {"max_new_tokens": 9, "min_new_tokens": 1, "temperature": 0.5, "top_k": 5, "top_p": 0.9,
                      "repetition_penalty": 1.1, "presence_penalty": 0.1, "frequency_penalty": 0.1,
                      "no_repeat_ngram_size": 3, "seed": 8, "stop": ("\n",), "num_beams": 2, "logprobs": 1,
                      "prompt_logprobs": 0, "constraint": Constraint("regex", "[a-z]+")}
TRANSLATION_CHANGES = {"num_beams": 2, "length_penalty": 0.5, "early_stopping": True, "num_return_sequences": 2,
                       "max_new_tokens": 10, "min_new_tokens": 1, "no_repeat_ngram_size": 2, "target_prefix": "A"}
NOT_IN_EQUALITY = {"compiled"}  # compare=False: what the constraint compiles to, a function of the constraint


def _key(params, **fields) -> str:
    return request_key(SCOPE, "generate", {"prompts": [[1, 2]], "params": params, **fields})


@pytest.mark.parametrize("base, changes", [(GenerationParams(max_new_tokens=8, seed=7), GENERATION_CHANGES),
                                           (TranslationParams(), TRANSLATION_CHANGES)],
                         ids=["generation", "translation"])
def test_every_parameter_that_changes_the_answer_changes_the_key(base, changes):
    keyed = {f.name for f in dataclasses.fields(base)} - NOT_IN_EQUALITY - {"priority"}
    assert keyed == set(changes), "a parameter without a test case here: add one"
    keys = {_key(base)} | {_key(dataclasses.replace(base, **{name: value})) for name, value in changes.items()}
    assert len(keys) == len(changes) + 1
    assert _key(base) == _key(dataclasses.replace(base))  # equal parameters: one key


def test_the_priority_and_the_compiled_constraint_are_not_in_the_key():
    params = GenerationParams(max_new_tokens=8, temperature=0, constraint=Constraint("choice", '["a"]', field="x"))
    assert _key(params) == _key(dataclasses.replace(params, priority=0)) == _key(dataclasses.replace(params,
                                                                                                   priority=2))
    assert _key(params) == _key(dataclasses.replace(params, compiled=object()))
    assert _key(params) == _key(dataclasses.replace(params, constraint=Constraint("choice", '["a"]', field="y")))


def test_inputs_and_the_capability_change_the_key_and_binary_inputs_are_framed():
    base = request_key(SCOPE, "classify", {"base64": [False, False]}, [b"ab", b"c"])
    assert base != request_key(SCOPE, "classify", {"base64": [False, False]}, [b"a", b"bc"])  # lengths framed
    assert base != request_key(SCOPE, "pixels", {"base64": [False, False]}, [b"ab", b"c"])
    assert base != request_key("1" * 64, "classify", {"base64": [False, False]}, [b"ab", b"c"])
    assert request_key(SCOPE, "translate", {"texts": ["a"]}) != request_key(SCOPE, "translate", {"texts": ["a "]})


def test_the_scope_covers_the_variant_the_provider_and_the_config_but_not_how_the_variant_was_chosen():
    scope = version_scope("gpt", 4, "gpt", "CPUExecutionProvider", VARIANT, CONFIG)
    others = [version_scope("gpt", 5, "gpt", "CPUExecutionProvider", VARIANT, CONFIG),
              version_scope("gpt2", 4, "gpt", "CPUExecutionProvider", VARIANT, CONFIG),
              version_scope("gpt", 4, "gpt", "CUDAExecutionProvider", VARIANT, CONFIG),
              version_scope("gpt", 4, "gpt", "CPUExecutionProvider", {**VARIANT, "weights": "fp32"}, CONFIG),
              version_scope("gpt", 4, "gpt", "CPUExecutionProvider", {**VARIANT, "speculation": "ngram"}, CONFIG),
              version_scope("gpt", 4, "gpt", "CPUExecutionProvider", VARIANT, {**CONFIG, "exported_at": "now"})]
    assert len({scope, *others}) == len(others) + 1
    assert scope == version_scope("gpt", 4, "gpt", "CPUExecutionProvider",
                                  {**VARIANT, "chosen_by": "cached measurement", "reason": "cached"}, CONFIG)


def test_canonical_refuses_what_it_cannot_serialise_the_same_way_twice():
    assert canonical({"a": (1, np.int64(2), np.float32(0.5))}) == {"a": [1, 2, 0.5]}
    with pytest.raises(TypeError):
        canonical({"a": object()})


def test_an_answer_reads_back_exactly():
    logprobs = [TokenLogprob(5, -0.1234567890123, [(5, -0.1234567890123), (6, -math.inf)]),
                TokenLogprob(7, -math.inf, [])]
    prompt = PromptLogprobs([TokenLogprob(1, -2.5, [(1, -2.5)])], [1])
    completions = [[Completion("a b", [5, 7], "stop", -1.0000000000000002, 3, logprobs, prompt, 2)],
                   [Completion("", [], "length", 0.0, 1)]]
    back = decode(encode(completions), (Completion, TokenLogprob, PromptLogprobs))
    assert back == completions
    assert isinstance(back[0][0].logprobs[0].top[0], tuple) and back[0][0].logprobs[1].logprob == -math.inf
    scored = Scored([TargetScore([4, 2], ["a", "</s>"], [-0.5, -1e-300])], 3)
    assert decode(encode(scored), (Scored, TargetScore)) == scored
    probabilities = np.random.default_rng(0).random((3, 10), dtype=np.float32)
    back = decode(encode(probabilities), ())
    assert back.dtype == np.float32 and back.shape == (3, 10) and back.tobytes() == probabilities.tobytes()
    back[0, 0] = 1.0  # a writable copy: callers may change what they got


def test_an_entry_decodes_only_into_the_classes_named():
    data = encode([[Completion("a", [1], "eos", -1.0, 1)]])
    with pytest.raises(Undecodable, match=r"an entry of class 'Completion', not one of \['Scored', 'TargetScore'\]"):
        decode(data, (Scored, TargetScore))
    with pytest.raises(Undecodable, match=r"utf-8|Expecting value"):  # the parser's own words
        decode(b"\x80 not json", (Completion,))
    with pytest.raises(TypeError, match="^a dict cannot be cached$"):
        encode({"a dict": 1})


def test_an_entry_is_compact_utf8_json():
    """What a Redis holds for every replica: no spaces, text as UTF-8 (not \\u escapes), tuples and arrays tagged."""
    encoded = encode([("Ein Hund läuft", 2), np.array([1, 2], np.int8)])
    assert encoded == '[{"~u":["Ein Hund läuft",2]},{"~a":["|i1",[2],"AQI="]}]'.encode()


def test_the_key_format_is_pinned():
    """Replicas of one release share a Redis: the same request must give the same key in every process and on every
    host. These digests pin the format (field names, JSON separators and ordering, non-ASCII text as UTF-8, the
    length framing of binary inputs); a change to it must bump KEY_FORMAT and these values together."""
    scope = version_scope("translation", 4, "translation", "CPUExecutionProvider",
                          {"weights": "int8", "attention": "mha", "kv_cache": "concat", "kv_residence": "host",
                           "speculation": "off", "chosen_by": "measured"},
                          {"architecture": {"d_model": 256}, "name": "Übersetzer"})
    assert scope == "1019658ad5586fe3a3892d08b671850e2583af7d8ba7da737c61795deee2bec2"
    key = request_key(scope, "translate", {"text": "Ein Hund läuft.", "num_beams": 4}, [b"\x00\x01", b""])
    assert key == "55f61a4fb935b21173fc06c2c8ed4c149d593808edd21d502ec1676e2ee9b400"
