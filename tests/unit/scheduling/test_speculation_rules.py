"""The rules of n-gram speculation, function by function (`service.scheduling.speculation`):

- `SpeculationConfig.from_settings`: None when `TSERVE_SPECULATION=off`, else the settings' draft and row limits;
- `speculable`: only with a config, 1..max_rows live rows, an engine that verifies drafts and greedy single-row
  searches (a backend or a search that does not say otherwise is not);
- `draft_for`: the drafter is brought up to date with the generated tokens (each one once), and the draft holds no
  more than `max_draft` tokens, nor than the search may still choose after its pending token, nor than fit in the
  context;
- `step_verified`: every fed position is stepped (however small the vocabulary), and a search that raises gets its
  exception in its place while the others go on.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from service.decoding import GreedySearch, SamplingSearch, StepResult
from service.decoding.ngram_draft import MAX_DRAFT, NGramDrafter
from service.scheduling.jobs import TextJob
from service.scheduling.speculation import SpeculationConfig, draft_for, speculable, step_verified
from service.settings import Settings
from tests.support.fake_decoding import ExplodingSearch

VOCAB = 12
CYCLE = [1, 2, 3] * 4  # a prompt that repeats: its continuation is drafted
ROOMY = 10_000  # a context length no draft here reaches


def job(prompt, search) -> TextJob:
    return TextJob(list(prompt), search, "greedy", time.monotonic() + 60)


def choose(search, tokens: list[int]) -> None:
    """Step `search` on logits whose argmax is each of `tokens` in turn."""
    for token in tokens:
        logits = np.zeros((1, VOCAB), np.float32)
        logits[0, token] = 1.0
        search.step(logits)


def full_length(context) -> NGramDrafter:
    """A drafter whose drafts have grown to MAX_DRAFT (every draft so far accepted)."""
    drafter = NGramDrafter(context)
    while drafter.draft_length < MAX_DRAFT:
        drafter.record(drafter.draft_length, drafter.draft_length)
    return drafter


def test_the_config_comes_from_the_settings_when_speculation_is_on():
    assert SpeculationConfig.from_settings(Settings.model_construct(speculation="off")) is None
    on = Settings.model_construct(speculation="ngram", speculation_max_draft=3, speculation_max_rows=2)
    assert SpeculationConfig.from_settings(on) == SpeculationConfig(max_draft=3, max_rows=2)


def test_a_step_speculates_only_with_a_verifying_engine_greedy_searches_and_live_rows():
    config = SpeculationConfig(max_draft=4, max_rows=2)
    verifier, plain = SimpleNamespace(speculates=True), SimpleNamespace()
    greedy = [job([1, 2], GreedySearch(5, None))]
    assert speculable(verifier, greedy, 1, config) is True
    assert speculable(plain, greedy, 1, config) is False  # an engine that does not say it verifies drafts
    assert speculable(verifier, greedy, 1, None) is False
    assert speculable(verifier, greedy * 3, 3, config) is False  # more rows than allowed
    assert speculable(verifier, [], 0, config) is False  # no live row: nothing to speculate on
    sampled = [job([1, 2], SamplingSearch(5, None, temperature=0.7, seed=1))]
    assert speculable(verifier, sampled, 1, config) is False
    unknown = [job([1, 2], SimpleNamespace(single_row=True, max_rows=1))]  # a single-row search of no temperature
    assert speculable(verifier, unknown, 1, config) is False


def test_the_drafter_follows_the_generated_tokens_once_each():
    prompt = [1, 2, 3, 4, 5, 6, 7]
    search = GreedySearch(50, None)
    drafter = NGramDrafter(prompt)
    choose(search, [1, 2, 3, 4, 5])  # the context now ends as the prompt began: 6, 7 follow
    assert draft_for(job(prompt, search), drafter, SpeculationConfig(), ROOMY) == [6, 7]
    choose(search, [6, 7])
    assert draft_for(job(prompt, search), drafter, SpeculationConfig(), ROOMY) == [1, 2]
    assert drafter.tokens == prompt + search.generated.tolist()


@pytest.mark.parametrize("limit, max_draft, max_new_tokens, context_length", [
    (MAX_DRAFT, MAX_DRAFT, 100, ROOMY),  # nothing binds but the drafter's own length
    (3, 3, 100, ROOMY),  # the config's max_draft
    (2, MAX_DRAFT, 4 + 3, ROOMY),  # 3 tokens left to choose: the pending one's successor and 2 drafted
    (1, MAX_DRAFT, 100, len(CYCLE) + 4 + 1),  # one position left in the context after the pending token's
], ids=["drafter", "max_draft", "max_new_tokens", "context"])
def test_a_draft_holds_no_more_than_the_config_the_search_and_the_context_allow(limit, max_draft, max_new_tokens,
                                                                            context_length):
    search = GreedySearch(max_new_tokens, None)
    choose(search, [1, 2, 3, 1])  # 4 generated: the last is the pending token
    draft = draft_for(job(CYCLE, search), full_length(CYCLE), SpeculationConfig(max_draft, 1), context_length)
    assert draft == ([2, 3, 1] * 3)[:limit]


def verify_logits(fed: list[int]) -> np.ndarray:
    """(S, VOCAB) logits whose argmax at position i is the next fed token (the last position: token 3)."""
    logits = np.zeros((len(fed), VOCAB), np.float32)
    logits[np.arange(len(fed)), fed[1:] + [3]] = 1.0
    return logits


def test_every_agreeing_position_is_stepped_even_past_the_vocabulary_size():
    fed = [0, 1, 2, 3, 0, 1, 2]  # 7 positions, a vocabulary of 4
    search = GreedySearch(20, None)
    (outcome,), kept = step_verified([search], verify_logits(fed)[None, :, :4], [fed])
    assert kept.tolist() == [7] and outcome.tokens.tolist() == [3]
    assert search.generated.tolist() == fed[1:] + [3]


def test_a_search_that_raises_at_a_verified_position_fails_alone():
    fed = [[5, 6, 7, 8], [1, 2, 3, 4]]
    searches = [ExplodingSearch(20, explode_at=2), GreedySearch(20, None)]
    outcomes, kept = step_verified(searches, np.stack([verify_logits(f) for f in fed]), fed)
    assert isinstance(outcomes[0], ValueError)
    assert isinstance(outcomes[1], StepResult) and kept[1] == 4
    assert searches[1].generated.tolist() == [2, 3, 4, 3]
