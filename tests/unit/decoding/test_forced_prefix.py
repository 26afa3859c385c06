"""A forced prefix (`service.decoding.forced_prefix`, CTranslate2's `target_prefix`) in every search, against a toy
model whose logits are a function of the whole sequence: the forced tokens are emitted first whatever the logits
say, and what follows is exactly what the same search decodes when the model is handed the prefix as part of its
start (tokens, scores, finish reasons: the prefix's log-probabilities are not scored, the length penalty and
max/min_new_tokens count the tokens after it, the n-gram ban sees it); searches with and without a prefix stepped
together decode as they do alone; a sampling search's draws start after the prefix."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from service.decoding import BeamSearch, GreedySearch, SamplingSearch, run_search
from service.decoding.forced_prefix import ForcedPrefix

V, BOS, EOS = 40, 1, 2
LOGIT_SCALE = 3.0  # spread of the toy logits: peaked enough that sequences end, flat enough that beams differ
FORCED = [7, 9, 7]  # the prefix, a repeated token among it (the n-gram ban must see it)


def toy_logits(history: tuple[int, ...]) -> np.ndarray:
    """Deterministic logits (V,) for a sequence: pseudo-random per sequence, EOS likelier as it grows."""
    rng = np.random.default_rng(zlib.crc32(np.asarray(history, np.int64).tobytes()))
    logits = rng.normal(size=V) * LOGIT_SCALE
    logits[EOS] += 0.5 * len(history) - 3.0
    return logits


def decode(searches, start: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
    """Drive `searches` with `run_search` on the toy model; search i's row starts as `start[i]` (what the model
    sees). Returns the sequences every step fed, per search, in order."""
    rows = list(start)
    owner = list(range(len(searches)))
    fed: list[list[tuple[int, ...]]] = [[] for _ in searches]

    def step_fn(tokens, parents):
        nonlocal rows, owner
        rows = [rows[p] + (int(t),) for t, p in zip(tokens, parents)]
        owner = [owner[p] for p in parents]
        for row, search in zip(rows, owner):
            fed[search].append(row)
        return np.stack([toy_logits(row) for row in rows])

    run_search(searches, [toy_logits(row) for row in rows], step_fn)
    return fed


SEARCHES = {
    "greedy": lambda **kw: GreedySearch(12, EOS, **kw),
    "greedy, n-gram ban and min_new_tokens": lambda **kw: GreedySearch(12, EOS, no_repeat_ngram_size=2,
                                                                      min_new_tokens=3, **kw),
    "sampling": lambda **kw: SamplingSearch(12, EOS, temperature=0.9, top_k=10, seed=5, **kw),
    "beam": lambda **kw: BeamSearch(4, 12, EOS, length_penalty=1.3, num_return_sequences=3, **kw),
    "beam, n-gram ban and min_new_tokens": lambda **kw: BeamSearch(3, 12, EOS, no_repeat_ngram_size=2,
                                                                  min_new_tokens=4, num_return_sequences=2, **kw),
}


@pytest.mark.parametrize("kind", SEARCHES)
def test_the_prefix_comes_first_then_the_search_continues_from_it(kind):
    forced = SEARCHES[kind](prefix=[BOS], forced_prefix=FORCED)
    fed = decode([forced], [(BOS,)])[0]
    assert fed[: len(FORCED)] == [(BOS, *FORCED[: i + 1]) for i in range(len(FORCED))]  # one row, one token a step
    assert all(row[: 1 + len(FORCED)] == (BOS, *FORCED) for row in fed[len(FORCED) :])  # every beam shares it
    # the reference: the same search started after the prefix, which its processors see as part of the sequence
    reference = SEARCHES[kind](prefix=[BOS, *FORCED])
    decode([reference], [(BOS, *FORCED)])
    assert forced.results() == reference.results()  # the tokens after the prefix, scored without it


@pytest.mark.parametrize("kind", ["greedy", "sampling"])
def test_the_score_sums_the_generated_tokens_log_probabilities_only(kind):
    search = SEARCHES[kind](prefix=[BOS], forced_prefix=FORCED)
    decode([search], [(BOS,)])
    (hypothesis,) = search.results()
    sequence = [BOS, *FORCED, *hypothesis.tokens] + ([EOS] if hypothesis.finish_reason == "eos" else [])
    logprobs = []
    for t in range(1 + len(FORCED), len(sequence)):
        logits = toy_logits(tuple(sequence[:t]))
        logprobs.append(logits[sequence[t]] - logits.max() - np.log(np.exp(logits - logits.max()).sum()))
    assert hypothesis.score == pytest.approx(sum(logprobs), abs=1e-9)


def test_a_forced_token_is_emitted_even_where_the_model_rules_it_out():
    search = GreedySearch(3, EOS, forced_prefix=[EOS, 5])
    logits = np.zeros((1, V))
    logits[0, EOS] = logits[0, 5] = -np.inf
    assert search.step(logits).tokens.tolist() == [EOS]  # not the end: a forced EOS is only a token
    assert search.step(logits).tokens.tolist() == [5]
    assert not search.done and search.generated.tolist() == []


def test_searches_with_and_without_a_prefix_decode_together_as_alone():
    def make():
        return [SEARCHES["greedy"](prefix=[BOS], forced_prefix=FORCED), SEARCHES["beam"](prefix=[BOS]),
                SEARCHES["beam"](prefix=[BOS], forced_prefix=FORCED[:1]), SEARCHES["sampling"](prefix=[BOS]),
                SEARCHES["sampling"](prefix=[BOS], forced_prefix=FORCED)]

    together = make()
    decode(together, [(BOS,)] * len(together))
    for i, search in enumerate(make()):
        decode([search], [(BOS,)])
        assert search.results() == together[i].results(), i


def test_a_prefix_holds_token_ids():
    with pytest.raises(ValueError, match="token ids >= 0"):
        ForcedPrefix([3, -1])
    assert ForcedPrefix().after([BOS]) == [BOS] and not ForcedPrefix().pending


def test_the_n_gram_ban_covers_the_prefix():
    """The model always prefers 7, then 9, then 3: after the forced 7 9, a free search takes 7, 7, then not 7 (7 7
    is taken) and not 9 either (7 9 is the prefix's)."""
    logits = np.zeros((1, V))
    logits[0, [7, 9, 3]] = [5.0, 4.0, 1.0]
    search = GreedySearch(3, EOS, no_repeat_ngram_size=2, prefix=[BOS], forced_prefix=[7, 9])
    while not search.done:
        search.step(logits)
    assert search.results()[0].tokens == [7, 7, 3]
