"""Warm-up's checks of a text engine's outputs (`service.models.warmup.warm_up_text`), against a fake engine: the
logits of the prompt pass and of the decoding step after it, one per token of the vocabulary the engine was built
with, every value finite; a version whose step graph computes NaN or scores another vocabulary does not load."""

from __future__ import annotations

import numpy as np
import pytest

from service.models.warmup import WarmUpFailed, warm_up_text

VOCAB = 16


class FakeTextEngine:
    """Prefill and step returning (1, width) logits; `step_logits` overrides what the step returns."""

    vocab_size = VOCAB

    def __init__(self, prefill_logits=None, step_logits=None):
        self.prefill_logits = np.zeros((1, VOCAB), np.float32) if prefill_logits is None else prefill_logits
        self.step_logits = np.zeros((1, VOCAB), np.float32) if step_logits is None else step_logits

    def prefill(self, prompts):
        return self.prefill_logits, "state"

    def step(self, state, tokens):
        assert state == "state" and tokens.shape == (1,)
        return self.step_logits


NAN_ROW = np.full((1, VOCAB), np.nan, np.float32)

CASES = {  # (engine, what the refusal says; None: it loads)
    "plausible outputs": (FakeTextEngine(), None),
    "a step computing NaN": (FakeTextEngine(step_logits=NAN_ROW), "a decoding step hold NaN"),
    "a step scoring another vocabulary": (FakeTextEngine(step_logits=np.zeros((1, VOCAB + 3), np.float32)),
                                          f"does not match the config's architecture.vocab_size ({VOCAB} per"),
    "a prompt pass computing infinity": (FakeTextEngine(prefill_logits=np.full((1, VOCAB), np.inf, np.float32)),
                                         "a short prompt hold NaN or infinite"),
    "a prompt pass scoring a wider vocabulary": (FakeTextEngine(prefill_logits=np.zeros((1, 2 * VOCAB))),
                                                 "outputs shape [1, 32]"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_warm_up_checks_the_prompt_pass_and_the_step(case):
    engine, refusal = CASES[case]
    if refusal is None:
        warm_up_text(engine, [1, 2])
        return
    with pytest.raises(WarmUpFailed) as refused:
        warm_up_text(engine, [1, 2])
    assert refusal in str(refused.value), str(refused.value)
