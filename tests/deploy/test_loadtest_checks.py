"""The load test's response checks and its client-side counts (deploy/locust/load_checks.py, load_extra.py), table
style, without locust or a server: a well-formed OpenAI / Open Inference Protocol answer passes and counts its work,
each way of breaking it is a failure (`Unexpected`)."""

from __future__ import annotations

import copy
import sys

import pytest

from tests.support import ROOT

LOCUST_DIR = ROOT / "deploy" / "locust"
if str(LOCUST_DIR) not in sys.path:
    sys.path.insert(0, str(LOCUST_DIR))

import load_checks  # noqa: E402 - after the sys.path set-up, as locust loads them
from load_checks import Unexpected  # noqa: E402
from load_extra import Extra  # noqa: E402
from load_settings import CHAT_TEMPLATE_TOKENS, DEFAULT_WEIGHTS, GPT_MODEL, TASKS, parse_weights  # noqa: E402

HEADER = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": GPT_MODEL}


def chat_stream(*contents: str, finish: str = "stop", completion_tokens: int = 2) -> list[dict]:
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    events = [{**HEADER, "choices": [role], "usage": None}]
    for i, text in enumerate(contents):
        last = i == len(contents) - 1
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish if last else None}
        events.append({**HEADER, "choices": [choice], "usage": None})
    usage = {"prompt_tokens": 20, "completion_tokens": completion_tokens, "total_tokens": 20 + completion_tokens}
    events.append({**HEADER, "choices": [], "usage": usage})
    return events


def test_a_well_formed_chat_stream_passes_and_counts_its_tokens():
    assert load_checks.check_chat_stream(chat_stream("I ", "will"), 20 + CHAT_TEMPLATE_TOKENS, 15) == 2


@pytest.mark.parametrize("break_it, why", [
    (lambda e: e[-1]["usage"].update(total_tokens=99), "total_tokens"),
    (lambda e: e[1]["choices"][0]["delta"].update(content="\n\nROMEO"), "end of its turn"),
    (lambda e: e.pop(0), "role"),
    (lambda e: e.pop(), "usage chunk"),
    (lambda e: e[2].update(id="chatcmpl-2"), "different ids"),
    (lambda e: e[2].update(model="other"), "model"),
    (lambda e: e[2]["choices"][0].update(finish_reason="length"), "length after"),
])
def test_each_way_of_breaking_a_chat_stream_is_a_failure(break_it, why):
    events = copy.deepcopy(chat_stream("I ", "will"))
    break_it(events)
    with pytest.raises(Unexpected, match=why):
        load_checks.check_chat_stream(events, 20 + CHAT_TEMPLATE_TOKENS, 15)


def test_open_inference_protocol_checks_count_sentences_tokens_and_images():
    translation = {"TRANSLATION": {"shape": [1], "data": ["Two dogs."]}, "SCORE": {"datatype": "FP32"}}
    assert load_checks.check_oip_translation(translation) == 1
    generation = {"TEXT": {"data": ["héllo"]}, "FINISH_REASON": {"data": ["length"]}}
    assert load_checks.check_oip_generation(generation) == len("héllo".encode())  # a token a byte
    images = {"PROBABILITIES": {"shape": [2, load_checks.CLASSES]}, "LABEL": {"data": ["Bag", "Coat"]}}
    assert load_checks.check_oip_classification(images, images=2) == 2
    with pytest.raises(Unexpected, match="PROBABILITIES"):
        load_checks.check_oip_classification(images, images=3)


def test_extra_counts_each_request_name_where_the_report_reads_it():
    extra = Extra()
    for name, amount in [("generate stream", 5), ("openai chat", 3), ("translate beam", 1), ("oip translate", 1),
                         ("classify", 4), ("oip classify", 2)]:
        extra.add(name, amount, first_token_ms=7.0 if name == "generate stream" else None)
    recorded = extra.as_dict()
    assert recorded["generated_tokens"]["generate stream"] == 5 and recorded["generated_tokens"]["openai chat"] == 3
    assert recorded["sentences"] == {"translate greedy": 0, "translate beam": 1, "oip translate": 1}
    assert recorded["images"] == 6 and recorded["ttft_ms"] == [7.0]
    assert set(recorded["settings"]["weights"]) == set(TASKS)


def test_task_weights_parse_and_refuse_unknown_names():
    assert parse_weights(DEFAULT_WEIGHTS)["classify"] == 3
    assert parse_weights("classify=1") == {**dict.fromkeys(TASKS, 0), "classify": 1}
    with pytest.raises(ValueError, match="bad item"):
        parse_weights("nope=1")
