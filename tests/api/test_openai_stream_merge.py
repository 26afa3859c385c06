"""The OpenAI stream's per-wake-up merge (service.api.openai.render.merge): one delta per choice that moved, none for
a choice whose tokens are only held back (a possible stop string) when no log-probabilities were asked for."""

from __future__ import annotations

from service.api.openai.render import merge
from service.serving.outputs import Completion
from service.serving.streaming import Finished, Piece


def test_held_back_tokens_without_logprobs_make_no_delta():
    deltas, failed = merge([Piece(0, "", [10]), Piece(1, "Good", [11]), Piece(0, "", [12])])
    assert [(d.choice, d.text, d.token_ids) for d in deltas] == [(1, "Good", [11])] and failed == []


def test_held_back_tokens_with_logprobs_still_send_them():
    deltas, _ = merge([Piece(0, "", [10], logprobs=["lp"])])
    assert [(d.choice, d.text, d.logprobs) for d in deltas] == [(0, "", ["lp"])]


def test_a_finish_is_sent_even_with_no_text_left():
    completion = Completion("ab", [1, 2], "eos", -1.0, 3)
    deltas, _ = merge([Piece(0, "", [2]), Finished(0, completion)])
    assert [(d.choice, d.text, d.completion) for d in deltas] == [(0, "", completion)]
    deltas, _ = merge([Finished(0, completion, rest="b")])
    assert deltas[0].text == "b"
