"""Unit tests of `service.decoding` on scripted logits and a toy history-dependent "model" (numpy only)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from service.decoding import (
    BeamSearch,
    GreedySearch,
    SamplingSearch,
    StopStrings,
    TokenLogprob,
    apply_openai_penalties,
    apply_repetition_penalty,
    apply_temperature,
    log_softmax,
    run_search,
    top_k_filter,
    top_p_filter,
    truncate_at_stop,
)
from service.decoding.distributions import log_normaliser, softmax, top_k_indices, top_logprobs
from service.decoding.ngrams import NGramBlocker

V = 16
EOS = 1


class ToyModel:
    """Logits depend on the whole row history (so wrong parent bookkeeping changes the output).

    ``prompts[i]`` is the prefill row of search ``i``; ``step_fn`` follows the `run_search` contract.
    """

    def __init__(self, prompts: list[list[int]], seed: int = 0, eos_bias: float = 0.0):
        rng = np.random.default_rng(seed)
        self.table = rng.standard_normal((V, V)) * 2.0  # (prev token, next token)
        self.pos = rng.standard_normal((64, V))  # (position, next token)
        self.eos_bias = eos_bias
        self.rows = [list(p) for p in prompts]
        self.calls: list[tuple[np.ndarray, np.ndarray]] = []

    def logits(self, hist: list[int]) -> np.ndarray:
        out = self.table[hist[-1]] + self.pos[len(hist)] + 0.05 * (sum(hist) % 7)
        out[EOS] += self.eos_bias
        return out.astype(np.float32)

    def first_logits(self) -> list[np.ndarray]:
        return [self.logits(r) for r in self.rows]

    def step_fn(self, tokens: np.ndarray, parents: np.ndarray) -> np.ndarray:
        self.calls.append((tokens.copy(), parents.copy()))
        self.rows = [self.rows[p] + [int(t)] for t, p in zip(tokens, parents)]
        return np.stack([self.logits(r) for r in self.rows])


def _drive(searches, prompts, **model_kw):
    model = ToyModel(prompts, **model_kw)
    run_search(searches, model.first_logits(), model.step_fn)
    return [s.results() for s in searches], model


def _onehot_logits(tok: int, v: int = V) -> np.ndarray:
    x = np.zeros((1, v), dtype=np.float32)
    x[0, tok] = 5.0
    return x


# --- helpers -------------------------------------------------------------------------------------------------


def test_log_softmax_stable_and_exact():
    x = np.array([[1000.0, 1001.0, -np.inf], [0.0, 0.0, 0.0]], dtype=np.float32)
    lp = log_softmax(x)
    assert lp.dtype == np.float64
    np.testing.assert_allclose(np.exp(lp).sum(-1), 1.0)
    np.testing.assert_allclose(lp[0, :2], [-np.log1p(np.e), 1 - np.log1p(np.e)], atol=1e-6)
    assert lp[0, 2] == -np.inf
    np.testing.assert_allclose(lp[1], -np.log(3))


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("hello world", ["wor"], ("hello ", True)),
        ("hello world", ["xyz"], ("hello world", False)),
        ("a.b;c", [";", "."], ("a", True)),  # earliest occurrence wins
        ("abc", [], ("abc", False)),
        ("abc", [""], ("abc", False)),
    ],
)
def test_truncate_at_stop(text, stops, expected):
    assert truncate_at_stop(text, stops) == expected


# --- no_repeat_ngram_size: the shared NGramBlocker -----------------------------------------------------------


def _banned_reference(seq: list[int], n: int) -> set[int]:
    """HF NoRepeatNGramLogitsProcessor by its definition: rescan every n-gram of the whole sequence."""
    if len(seq) + 1 < n:
        return set()
    suffix = tuple(seq[len(seq) - n + 1 :]) if n > 1 else ()
    return {seq[j + n - 1] for j in range(len(seq) - n + 1) if tuple(seq[j : j + n - 1]) == suffix}


@pytest.mark.parametrize(
    ("n", "seq", "banned"),
    [
        (1, [], set()),  # nothing seen yet
        (1, [5], {5}),  # n=1 bans every token seen so far
        (1, [5, 3, 5, 9], {3, 5, 9}),
        (2, [], set()),
        (2, [4], set()),  # one token: no complete bigram yet
        (2, [4, 4], {4}),
        (2, [1, 2, 3], set()),  # last token 3 was never followed by anything
        (2, [1, 2, 3, 1], {2}),
        (2, [1, 2, 1, 3, 1], {2, 3}),  # every follower of the suffix
        (3, [1, 2], set()),
        (3, [1, 2, 1, 2], {1}),
        (3, [1, 2, 3, 1, 2], {3}),
        (3, [7, 7, 7], {7}),
        (4, [1, 2, 3], set()),  # n larger than the sequence: nothing
        (5, [7, 7, 7, 7], set()),  # n larger than the sequence, even when everything repeats
        (5, [7, 7, 7, 7, 7], {7}),
        (2, [6, 6, 6, 6], {6}),
    ],
)
def test_ngram_blocker_table(n, seq, banned):
    assert _banned_reference(seq, n) == banned  # the table itself agrees with the definition
    blocker = NGramBlocker(n, seq)
    assert set(blocker.banned()) == banned
    assert sorted(blocker.banned_ids(V).tolist()) == sorted(banned)
    row = np.arange(V, dtype=np.float64)
    out = blocker.apply(row)
    assert set(np.flatnonzero(np.isneginf(out)).tolist()) == banned
    assert not np.isneginf(row).any()  # the input row is never modified
    if not banned:
        assert out is row


def test_ngram_blocker_counts_the_prefix():
    # (4, 4) is in the prefix: 4 may not follow 4; the same tokens without the prefix ban nothing
    assert set(NGramBlocker(2, [4, 4]).banned()) == {4}
    b = NGramBlocker(2, [9, 4])
    assert set(b.banned()) == set()
    b.append(4)  # (4, 4) generated once: banned from now on after a 4
    assert set(b.banned()) == {4}
    # greedy and sampling see the prefix too: a model that always wants 4 can't take it after [4, 4]
    table = np.full(V, -2.0, dtype=np.float32)
    table[4], table[6] = 5.0, 3.0
    for search in (GreedySearch(1, EOS, no_repeat_ngram_size=2, prefix=[4, 4]),
                   SamplingSearch(1, EOS, temperature=0.0, no_repeat_ngram_size=2, prefix=[4, 4])):
        search.step(table[None, :])
        assert search.results()[0].tokens == [6]
    plain = GreedySearch(1, EOS, no_repeat_ngram_size=2)  # no prefix: nothing to repeat
    plain.step(table[None, :])
    assert plain.results()[0].tokens == [4]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ngram_blocker_updates_incrementally(n):
    """Appending token by token gives, after every token, the ban of a full rescan of the sequence so far."""
    rng = np.random.default_rng(n)
    seq = rng.integers(0, 3, size=40).tolist()  # a tiny alphabet: lots of repeats
    blocker = NGramBlocker(n, seq[:3])
    hits = 0
    for i in range(3, len(seq)):
        assert set(blocker.banned()) == _banned_reference(seq[:i], n), i
        hits += bool(blocker.banned())
        blocker.append(seq[i])
    assert hits > 10


def test_ngram_blocker_scripted_steps():
    b = NGramBlocker(2)
    expected = [set(), set(), set(), {2}, set(), {1}, {2, 3}]
    for tok, ban in zip([1, 2, 1, 3, 2, 1, 9], expected):
        assert set(b.banned()) == ban
        b.append(tok)


def test_ngram_blocker_copy_is_independent_and_ids_stay_in_vocab():
    b = NGramBlocker(2, [3, 20, 3])  # 20 lies outside a vocabulary of V=16
    assert set(b.banned()) == {20} and b.banned_ids(V).size == 0
    assert b.apply(np.zeros(V)).min() == 0.0  # HF ignores ids past the logits
    c = b.copy()
    c.append(5)
    c.append(3)
    assert set(c.banned()) == {20, 5} and set(b.banned()) == {20}
    b.append(7)
    assert set(b.banned()) == set() and set(c.banned()) == {20, 5}
    with pytest.raises(ValueError):
        NGramBlocker(0)


def test_ngram_blocker_state_is_local():
    """The per-token work does not depend on the length: only the last n-1 tokens are kept besides the dict."""
    b = NGramBlocker(3, list(range(100)))
    assert b._tail == (98, 99)
    b.append(5)
    assert b._tail == (99, 5) and len(b._next) == 99  # one entry per distinct bigram that was completed


def _repeats_after(seq: list[int], start: int, n: int) -> list[int]:
    """Positions j >= start at which the n-gram ending at j already ended somewhere before j."""
    out = []
    for j in range(max(start, n - 1), len(seq)):
        gram = tuple(seq[j - n + 1 : j + 1])
        if any(tuple(seq[k - n + 1 : k + 1]) == gram for k in range(n - 1, j)):
            out.append(j)
    return out


class BigramModel:
    """Logits depend only on the last token and are peaked: unconstrained decoding falls into short cycles."""

    def __init__(self, prompts: list[list[int]], seed: int):
        rng = np.random.default_rng(seed)
        self.table = (rng.standard_normal((V, V)) * 3.0).astype(np.float32)
        self.table[:, EOS] -= 4.0  # EOS rare, so sequences run long enough to repeat
        self.rows = [list(p) for p in prompts]

    def first_logits(self) -> list[np.ndarray]:
        return [self.table[r[-1]] for r in self.rows]

    def step_fn(self, tokens: np.ndarray, parents: np.ndarray) -> np.ndarray:
        self.rows = [self.rows[p] + [int(t)] for t, p in zip(tokens, parents)]
        return np.stack([self.table[r[-1]] for r in self.rows])


def _property_searches(rng, prompts: list[list[int]], ngram: int, seed: int, max_new: int) -> list:
    """A greedy, a sampling and a beam search with random settings, one per prompt."""
    return [
        GreedySearch(max_new, EOS, min_new_tokens=int(rng.integers(0, 3)), no_repeat_ngram_size=ngram,
                     prefix=prompts[0]),
        SamplingSearch(max_new, EOS, temperature=float(rng.uniform(0.5, 2.0)), top_k=int(rng.integers(0, 8)),
                       top_p=float(rng.uniform(0.5, 1.0)), repetition_penalty=float(rng.uniform(0.8, 1.5)),
                       seed=seed, prefix=prompts[1], no_repeat_ngram_size=ngram),
        BeamSearch(3, max_new, EOS, num_return_sequences=3, no_repeat_ngram_size=ngram, prefix=prompts[2]),
    ]


def _property_outputs(searches, prompts: list[list[int]], seed: int) -> list[tuple[list[int], int]]:
    """(prompt + generated (+ EOS), prompt length) of every hypothesis, driven together on a `BigramModel`."""
    model = BigramModel(prompts, seed)
    run_search(searches, model.first_logits(), model.step_fn)
    return [
        (p + h.tokens + ([EOS] if h.finish_reason == "eos" else []), len(p))
        for s, p in zip(searches, prompts)
        for h in s.results()
    ]


def test_property_no_repeated_ngram_in_generated_output():
    """Random prompts, sizes and models: no n-gram ending at a generated token (EOS included) repeats an earlier
    n-gram of prompt + generated tokens, for greedy, sampling and beam search alike, batched together."""
    plain_repeats = checked = 0
    max_new = 8  # prompt (<= 5) + 8 new < V = 16: a token is always left even for n = 1
    for seed in range(60):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(1, 4))
        prompts = [rng.integers(2, 6, size=int(rng.integers(1, 6))).tolist() for _ in range(3)]
        for seq, start in _property_outputs(_property_searches(rng, prompts, n, seed, max_new), prompts, seed):
            assert _repeats_after(seq, start, n) == [], (seed, n, seq, start)
            checked += 1
        plain = _property_outputs(_property_searches(rng, prompts, 0, seed, max_new), prompts, seed)
        plain_repeats += sum(bool(_repeats_after(seq, start, n)) for seq, start in plain)
    assert checked == 60 * 5
    assert plain_repeats > 100  # not vacuous: without the ban most of these outputs do repeat n-grams


@pytest.mark.parametrize("cls", [GreedySearch, SamplingSearch, BeamSearch])
def test_no_repeat_ngram_size_must_not_be_negative(cls):
    args = (2, 5, EOS) if cls is BeamSearch else (5, EOS)
    with pytest.raises(ValueError):
        cls(*args, no_repeat_ngram_size=-1)
    cls(*args, no_repeat_ngram_size=0)  # 0 = off


def test_greedy_no_repeat_ngram_score_stays_raw_log_prob_sum():
    """The ban changes which token is chosen, not how it is scored: sum of log-softmax of the raw logits."""
    table = np.full(V, -1.0, dtype=np.float32)
    table[3], table[7], table[EOS] = 4.0, 2.0, -5.0
    for search in (GreedySearch(4, EOS, no_repeat_ngram_size=1),
                   SamplingSearch(4, EOS, temperature=0.0, repetition_penalty=1.5, no_repeat_ngram_size=1)):
        while not search.done:
            search.step(table[None, :])
        (h,) = search.results()
        assert h.tokens[:2] == [3, 7] and len(set(h.tokens)) == 4  # n=1: no token twice
        lp = log_softmax(table)
        assert h.score == pytest.approx(float(sum(lp[t] for t in h.tokens)))


# --- greedy --------------------------------------------------------------------------------------------------


def test_greedy_eos_excluded_and_score():
    s = GreedySearch(max_new_tokens=5, eos_token_id=EOS)
    assert s.num_rows == 1 and not s.done
    r = s.step(_onehot_logits(7))
    assert r.tokens.tolist() == [7] and r.parents.tolist() == [0] and not r.done
    r = s.step(_onehot_logits(EOS))
    assert r.done and r.tokens.size == 0 and s.num_rows == 0
    (h,) = s.results()
    assert h.tokens == [7] and h.finish_reason == "eos"
    expected = 2 * float(log_softmax(_onehot_logits(7))[0, 7])
    assert h.score == pytest.approx(expected)
    with pytest.raises(RuntimeError):
        s.step(_onehot_logits(3))


def test_greedy_length_and_min_new_tokens():
    s = GreedySearch(max_new_tokens=3, eos_token_id=EOS, min_new_tokens=2)
    for tok in (EOS, EOS):  # EOS masked: the runner-up (token 0, logit 0) is chosen instead
        assert s.step(_onehot_logits(tok)).tokens.tolist() == [0]
    assert s.step(_onehot_logits(4)).done
    (h,) = s.results()
    assert h.tokens == [0, 0, 4] and h.finish_reason == "length"


def test_greedy_accepts_several_eos_ids():
    s = GreedySearch(max_new_tokens=5, eos_token_id=[EOS, 9])
    s.step(_onehot_logits(3))
    assert s.step(_onehot_logits(9)).done
    assert s.results()[0].finish_reason == "eos" and s.results()[0].tokens == [3]


def test_stop_strings_end_with_stop_and_caller_truncates():
    vocab = {i: chr(ord("a") + i) for i in range(V)}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    s = GreedySearch(max_new_tokens=10, eos_token_id=EOS, stop_checker=StopStrings(["ef"], decode))
    for tok in (3, 4, 5, 6):  # d e f g -> stops after "f"
        r = s.step(_onehot_logits(tok))
        if r.done:
            break
    (h,) = s.results()
    assert h.finish_reason == "stop" and h.tokens == [3, 4, 5]
    assert truncate_at_stop(decode(h.tokens), ["ef"]) == ("d", True)


def test_stop_strings_decode_each_token_once_and_see_new_occurrences():
    decoded = []

    def decode(ids):
        decoded.append(len(ids))
        return "".join("xyz"[i % 3] if i < 3 else "-" for i in ids)

    checker = StopStrings(["xyz"], decode)
    tokens = np.array([5, 5, 5, 0, 1, 2, 5])
    assert [checker(tokens[:n]) for n in range(1, 6)] == [False] * 5
    assert checker(tokens[:6])  # "---xyz": found when its last token arrives
    assert max(decoded) <= 2  # a window of one or two tokens per step, never the whole sequence
    assert checker(tokens[:3]) is False  # a shorter array is a new row: it starts again
    many = StopStrings(["xyz"], decode)
    assert not many(tokens[:5]) and many(tokens)  # several new tokens at once


# --- sampling ------------------------------------------------------------------------------------------------


def _sample(n: int = 3, **kw) -> list[list[int]]:
    prompts = [[0, 2 + i] for i in range(n)]
    searches = [SamplingSearch(12, EOS, prefix=p, **kw) for p in prompts]
    results, _ = _drive(searches, prompts)
    return [r[0].tokens for r in results]


def _greedy(n: int = 3) -> list[list[int]]:
    prompts = [[0, 2 + i] for i in range(n)]
    results, _ = _drive([GreedySearch(12, EOS) for _ in prompts], prompts)
    return [r[0].tokens for r in results]


def test_sampling_same_seed_same_output():
    assert _sample(seed=123, temperature=1.3) == _sample(seed=123, temperature=1.3)
    outs = {tuple(map(tuple, _sample(seed=s, temperature=1.5))) for s in range(5)}
    assert len(outs) > 1  # different seeds explore


@pytest.mark.parametrize(
    "kw",
    [dict(top_k=1), dict(top_p=1e-9), dict(temperature=0.0), dict(temperature=0.0, top_k=3, top_p=0.5)],
    ids=["top_k=1", "top_p_tiny", "temperature=0", "temperature=0_ignores_filters"],
)
def test_sampling_degenerates_to_greedy(kw):
    assert _sample(seed=7, **kw) == _greedy()


def test_sampling_score_is_raw_log_prob_sum():
    prompts = [[0, 3]]
    (res,), model = _drive([SamplingSearch(6, EOS, temperature=2.0, top_k=4, seed=1)], prompts)
    hist = [0, 3]
    total = 0.0
    for t in res[0].tokens:
        total += float(log_softmax(model.logits(hist))[t])
        hist.append(t)
    if res[0].finish_reason == "eos":
        total += float(log_softmax(model.logits(hist))[EOS])
    assert res[0].score == pytest.approx(total, abs=1e-9)


def test_repetition_penalty_discourages_repeats():
    table = np.full(V, -3.0, dtype=np.float32)
    table[5], table[6] = 4.0, 3.0  # token 5 always wins without a penalty

    def run(penalty):
        s = SamplingSearch(4, EOS, temperature=0.0, repetition_penalty=penalty, prefix=[5])
        while not s.done:
            s.step(table[None, :])
        return s.results()[0].tokens

    assert run(1.0) == [5, 5, 5, 5]
    # 5 is in the prefix: 4/2 = 2 < 3 picks 6; then 6 is seen too: 3/2 = 1.5 < 2 picks 5 again
    assert run(2.0) == [6, 5, 5, 5]
    # negative logits get multiplied (more negative): an unseen -3 beats a seen -2 * 2 = -4
    t2 = np.full(V, -5.0, dtype=np.float32)
    t2[5], t2[6] = -2.0, -3.0
    s = SamplingSearch(1, EOS, temperature=0.0, repetition_penalty=2.0, prefix=[5])
    s.step(t2[None, :])
    assert s.results()[0].tokens == [6]


def test_sampling_respects_min_new_tokens_and_filters():
    logits = np.zeros((1, V), dtype=np.float32)
    logits[0, EOS] = 50.0  # EOS dominates unless masked
    logits[0, 3] = 40.0
    s = SamplingSearch(5, EOS, top_k=2, min_new_tokens=2, seed=0)
    assert s.step(logits).tokens.tolist() == [3]  # EOS masked first, then top-k: 3 dominates the rest
    assert s.step(logits).tokens.tolist() == [3]
    assert s.step(logits).done and s.results()[0].finish_reason == "eos"


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0.0), dict(top_k=-1), dict(repetition_penalty=0)])
def test_sampling_rejects_bad_args(kw):
    with pytest.raises(ValueError):
        SamplingSearch(5, EOS, **kw)


# --- beam ----------------------------------------------------------------------------------------------------


def test_beam_with_one_beam_equals_greedy():
    prompts = [[0, 2], [0, 5, 9], [0, 11]]
    for eos_bias in (0.0, 2.5):
        beams, _ = _drive([BeamSearch(1, 12, EOS) for _ in prompts], prompts, eos_bias=eos_bias)
        greedy, _ = _drive([GreedySearch(12, EOS) for _ in prompts], prompts, eos_bias=eos_bias)
        for b, g in zip(beams, greedy):
            assert b[0].tokens == g[0].tokens and b[0].finish_reason == g[0].finish_reason
            n = len(g[0].tokens) + (g[0].finish_reason == "eos")
            assert b[0].score == pytest.approx(g[0].score / n)  # beam scores are length-normalised


def test_beam_rows_and_parents_bookkeeping():
    s = BeamSearch(num_beams=3, max_new_tokens=4, eos_token_id=EOS, num_return_sequences=3)
    assert s.num_rows == 1
    model = ToyModel([[0, 4]])
    r = s.step(model.first_logits()[0][None, :])
    assert r.parents.tolist() == [0, 0, 0]  # all beams continue the single prefill row
    assert len(set(r.tokens.tolist())) == 3 and s.num_rows == 3
    while not r.done:
        logits = model.step_fn(r.tokens, r.parents)
        assert logits.shape == (s.num_rows, V)
        r = s.step(logits)
        assert np.all((r.parents >= 0) & (r.parents < 3)) and r.tokens.shape == r.parents.shape
    assert s.done and s.num_rows == 0 and r.tokens.size == 0
    hyps = s.results()
    assert len(hyps) == 3
    assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    # every hypothesis is a real path of the toy model: rescoring it reproduces the score
    for h in hyps:
        hist, total = [0, 4], 0.0
        for t in h.tokens + ([EOS] if h.finish_reason == "eos" else []):
            total += float(log_softmax(model.logits(hist))[t])
            hist.append(t)
        n = len(h.tokens) + (h.finish_reason == "eos")
        assert h.score == pytest.approx(total / n)


def test_beam_can_finish_on_prefill_logits():
    searches = [BeamSearch(2, 1, EOS, num_return_sequences=2), GreedySearch(3, EOS)]
    results, model = _drive(searches, [[0, 3], [0, 4]])
    assert [len(r) for r in results] == [2, 1]
    assert all(len(h.tokens) <= 1 for h in results[0])
    # only the greedy row keeps running: prefill row 1 on the first call, then row 0 of the previous call
    assert [p.tolist() for _, p in model.calls] == [[1], [0]]


def test_run_search_batched_equals_alone():
    """Mixed searches in one batch give the same results as each one alone (global parent offsets)."""
    prompts = [[0, 2], [0, 3, 7], [0, 9], [0, 12, 13, 14]]

    def make():
        return [
            BeamSearch(4, 8, EOS, num_return_sequences=2, no_repeat_ngram_size=2, prefix=prompts[0]),
            GreedySearch(5, EOS),
            BeamSearch(3, 8, EOS, early_stopping=True, length_penalty=0.5),
            SamplingSearch(8, EOS, temperature=0.9, top_p=0.9, seed=3),
        ]

    together, _ = _drive(make(), prompts, eos_bias=2.0)
    alone = [_drive([s], [p], eos_bias=2.0)[0][0] for s, p in zip(make(), prompts)]
    assert together == alone


def test_beam_no_repeat_ngram_includes_prefix():
    # A bigram model that loves 4 -> 4: with n=2 and prefix [4, 4] already holding (4, 4), 4 is banned after 4.
    table = np.full(V, -2.0, dtype=np.float32)
    table[4] = 5.0
    s = BeamSearch(2, 3, EOS, no_repeat_ngram_size=2, prefix=[4, 4])
    r = s.step(table[None, :])
    assert 4 not in r.tokens.tolist()


@pytest.mark.parametrize(
    "kw",
    [dict(num_beams=0), dict(num_return_sequences=3), dict(early_stopping="sometimes"), dict(max_new_tokens=0)],
)
def test_beam_rejects_bad_args(kw):
    args = dict(num_beams=2, max_new_tokens=5, eos_token_id=EOS) | kw
    with pytest.raises(ValueError):
        BeamSearch(**args)


def test_step_checks_row_count():
    s = BeamSearch(2, 5, EOS)
    with pytest.raises(ValueError):
        s.step(np.zeros((2, V), dtype=np.float32))  # the first step takes the single prefill row
    with pytest.raises(RuntimeError):
        s.results()


def test_a_temperature_too_small_to_divide_by_is_greedy():
    """logits / 1e-300 overflow to inf and the probabilities to NaN: below 1e-5 sampling is greedy (as vLLM)."""
    import warnings

    logits = np.random.default_rng(0).standard_normal((1, 50)) * 10
    for temperature in (1e-300, 1e-9, 9e-6):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            search = SamplingSearch(3, None, temperature=temperature, top_k=5, top_p=0.5, seed=1)
            assert search.step(logits).tokens.tolist() == [int(np.argmax(logits))]


# --- per-token log-probabilities (OpenAI logprobs / top_logprobs) ----------------------------------------------


def _expected_top(raw: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n most likely tokens of the raw row by definition: full sort by (-log-prob, id)."""
    lp = log_softmax(raw)
    ids = sorted(range(raw.shape[-1]), key=lambda j: (-lp[j], j))[:n]
    return [(j, float(lp[j])) for j in ids]


def _drive_recording(search, prompt: list[int], check_alignment: bool = True, **model_kw):
    """Drive one search on a `ToyModel`, returning the raw logits row (V,) it received at every step.

    After every step the recorded log-probs must be aligned with ``generated`` (what the streaming code reads)."""
    model = ToyModel([prompt], **model_kw)
    rows = [model.first_logits()[0]]
    res = search.step(rows[-1][None, :])
    while True:
        if check_alignment:
            gen = search.generated.tolist()
            assert [r.token_id for r in search.token_logprobs] == gen
        if res.done:
            return rows
        rows.append(model.step_fn(res.tokens, res.parents)[0])
        res = search.step(rows[-1][None, :])


@pytest.mark.parametrize("n", [0, 1, 3, V - 1, V, V + 5])
@pytest.mark.parametrize("eos_bias", [0.0, 3.0])
def test_greedy_logprobs_are_raw_log_softmax(n, eos_bias):
    search = GreedySearch(10, EOS, logprobs=n)
    rows = _drive_recording(search, [0, 5], eos_bias=eos_bias)
    (h,) = search.results()
    assert h.logprobs == search.token_logprobs and h.logprobs is not search.token_logprobs  # a copy
    assert len(h.logprobs) == len(h.tokens) and [r.token_id for r in h.logprobs] == h.tokens
    for rec, tok, raw in zip(h.logprobs, h.tokens, rows):
        assert isinstance(rec, TokenLogprob)
        assert rec.logprob == float(log_softmax(raw)[tok])  # bit-identical to log_softmax of the raw row
        expected = _expected_top(raw, n)
        assert [t for t, _ in rec.top] == [t for t, _ in expected]
        np.testing.assert_allclose([lp for _, lp in rec.top], [lp for _, lp in expected], rtol=0, atol=1e-12)
        assert len(rec.top) == min(n, V)
        assert all(isinstance(t, int) and isinstance(lp, float) for t, lp in rec.top)
        if n:
            assert rec.top[0][0] == tok  # greedy: the argmax of the raw row is the best alternative
    chosen = sum(r.logprob for r in h.logprobs)
    if h.finish_reason == "eos":
        eos_lp = float(log_softmax(rows[len(h.tokens)])[EOS])
        assert chosen == pytest.approx(h.score - eos_lp, abs=1e-9)
    else:
        assert chosen == pytest.approx(h.score, abs=1e-12)


def test_logprobs_cover_eos_and_length_endings():
    """Guard: the parametrised test above sees both endings."""
    reasons = set()
    for eos_bias in (0.0, 3.0):
        s = GreedySearch(10, EOS, logprobs=1)
        _drive_recording(s, [0, 5], eos_bias=eos_bias)
        reasons.add(s.results()[0].finish_reason)
    assert reasons == {"eos", "length"}


def test_logprobs_eos_not_recorded_and_score_includes_it():
    s = GreedySearch(5, EOS, logprobs=2)
    s.step(_onehot_logits(7))
    assert [r.token_id for r in s.token_logprobs] == [7] == s.generated.tolist()
    s.step(_onehot_logits(EOS))
    (h,) = s.results()
    assert h.finish_reason == "eos" and h.tokens == [7] and len(h.logprobs) == 1
    lp = log_softmax(_onehot_logits(7))[0]
    assert h.logprobs[0].logprob == lp[7] and h.score == pytest.approx(2 * lp[7])
    assert h.logprobs[0].top == [(7, lp[7]), (0, lp[0])]  # the 15 tied zeros: lowest id first


def test_logprobs_stop_token_is_recorded_and_aligned_while_streaming():
    vocab = {i: chr(ord("a") + i) for i in range(V)}

    def decode(ids):
        return "".join(vocab[i] for i in ids)

    s = GreedySearch(10, EOS, stop_checker=StopStrings(["ef"], decode), logprobs=0)
    streamed = []
    for tok in (3, 4, 5, 6):
        res = s.step(_onehot_logits(tok))
        new = s.generated.tolist()[len(streamed):]  # what a scheduler streams after this step
        streamed += [(t, s.token_logprobs[len(streamed) + i]) for i, t in enumerate(new)]
        assert len(s.token_logprobs) == len(s.generated)
        if res.done:
            break
    (h,) = s.results()
    assert h.finish_reason == "stop" and h.tokens == [3, 4, 5]
    assert [t for t, _ in streamed] == [3, 4, 5] == [r.token_id for r in h.logprobs]
    assert all(r.top == [] for _, r in streamed)  # N = 0: only the chosen token's log-prob
    assert sum(r.logprob for r in h.logprobs) == pytest.approx(h.score, abs=1e-12)


def test_logprobs_none_records_nothing():
    for search in (GreedySearch(6, EOS), SamplingSearch(6, EOS, seed=0, temperature=1.2)):
        rows = _drive_recording(search, [0, 4], check_alignment=False)
        assert len(rows) >= 1
        assert search.token_logprobs == [] and search._logprobs is None
        assert search.results()[0].logprobs is None
    beam = BeamSearch(3, 6, EOS, num_return_sequences=3)
    _drive([beam], [[0, 4]])
    assert all(h.logprobs is None for h in beam.results())


@pytest.mark.parametrize("cls", [GreedySearch, SamplingSearch])
def test_logprobs_must_not_be_negative(cls):
    with pytest.raises(ValueError):
        cls(5, EOS, logprobs=-1)
    cls(5, EOS, logprobs=0)


def test_logprobs_do_not_change_tokens_or_scores():
    for make in (lambda lp: GreedySearch(10, EOS, min_new_tokens=2, no_repeat_ngram_size=2, prefix=[0, 5],
                                         logprobs=lp),
                 lambda lp: SamplingSearch(10, EOS, temperature=1.4, top_k=6, top_p=0.9, seed=5, prefix=[0, 5],
                                           repetition_penalty=1.2, presence_penalty=0.4, frequency_penalty=0.3,
                                           logprobs=lp)):
        off, on = make(None), make(4)
        _drive_recording(off, [0, 5], check_alignment=False)
        _drive_recording(on, [0, 5])
        (a,), (b,) = off.results(), on.results()
        assert (a.tokens, a.score, a.finish_reason) == (b.tokens, b.score, b.finish_reason)


def test_sampling_logprobs_are_of_the_raw_distribution():
    """Temperature, top-k, top-p, penalties and the n-gram ban change the draw, not what is recorded."""
    search = SamplingSearch(12, EOS, temperature=1.7, top_k=3, top_p=0.8, repetition_penalty=1.3,
                            presence_penalty=0.8, frequency_penalty=0.6, no_repeat_ngram_size=2, seed=11,
                            prefix=[0, 6], logprobs=5)
    processed_differs = False
    model = ToyModel([[0, 6]])
    rows = [model.first_logits()[0]]
    while True:
        processed = search.process_logits(rows[-1].astype(np.float64))
        res = search.step(rows[-1][None, :])
        assert [r.token_id for r in search.token_logprobs] == search.generated.tolist()
        if search.generated.size == len(rows):  # a token was appended at this step
            rec = search.token_logprobs[-1]
            raw = rows[-1]
            assert rec.logprob == float(log_softmax(raw)[rec.token_id])
            assert rec.top == _expected_top(raw, 5)  # ids in order, log-probs bit-identical to log_softmax
            kept = ~np.isneginf(processed)
            proc_lp = log_softmax(np.where(kept, processed, -np.inf))
            processed_differs |= not np.isclose(proc_lp[rec.token_id], rec.logprob)
        if res.done:
            break
        rows.append(model.step_fn(res.tokens, res.parents)[0])
    assert len(search.generated) >= 3
    assert processed_differs  # not vacuous: the processed distribution is a different one


@pytest.mark.parametrize("seed", range(20))
def test_top_logprobs_ties_break_by_lower_id(seed):
    rng = np.random.default_rng(seed)
    v = int(rng.integers(2, 40))
    row = rng.integers(-3, 3, size=v).astype(np.float64)  # few distinct values: many ties, at the boundary too
    if seed % 4 == 0:
        row[rng.integers(0, v, size=v // 3)] = -np.inf
    m = row.max()
    log_z = np.log(np.sum(np.exp(row - m)))
    for n in range(v + 2):
        got = top_logprobs(row, n, m, log_z)
        expected = _expected_top(row, n)
        assert [t for t, _ in got] == [t for t, _ in expected], (n, row.tolist())
        assert [lp for _, lp in got] == [lp for _, lp in expected]  # bit-identical to log_softmax


def test_top_logprobs_scattered_tie_at_the_boundary():
    row = np.zeros(V)
    row[[14, 9, 2, 5]] = 3.0
    row[7] = 4.0
    m = row.max()
    log_z = np.log(np.sum(np.exp(row - m)))
    assert [t for t, _ in top_logprobs(row, 3, m, log_z)] == [7, 2, 5]
    assert [t for t, _ in top_logprobs(row, 6, m, log_z)] == [7, 2, 5, 9, 14, 0]


# --- OpenAI presence_penalty / frequency_penalty ---------------------------------------------------------------


def _penalised_reference(raw, prefix, generated, presence, frequency, repetition=1.0, temperature=1.0):
    """vLLM ``apply_penalties`` by its definition: repetition penalty over prompt + output, then
    ``-= frequency * count + presence * (count > 0)`` with counts over the OUTPUT tokens only; then temperature."""
    x = np.array(raw, dtype=np.float64)
    seen = set(prefix) | set(generated)
    for j in range(x.shape[0]):
        if repetition != 1.0 and j in seen:
            x[j] = x[j] * repetition if x[j] < 0 else x[j] / repetition
        c = generated.count(j)
        x[j] -= frequency * c + presence * (c > 0)
    return x / temperature


def _force(search, tokens: list[int], v: int) -> None:
    """Make ``search`` generate ``tokens`` (one-hot logits far above any penalty)."""
    for t in tokens:
        forced = np.zeros((1, v), dtype=np.float32)
        forced[0, t] = 60.0
        assert search.step(forced).tokens.tolist() == [t]


_RAW6 = [1.0, 2.0, -1.0, 0.5, 0.0, 3.0]


@pytest.mark.parametrize(
    ("prefix", "generated", "presence", "frequency", "repetition", "expected"),
    [
        ([], [], 1.5, 1.5, 1.0, _RAW6),  # nothing generated: nothing penalised
        ([0, 5], [], 2.0, 2.0, 1.0, _RAW6),  # the prompt does not count
        ([], [2, 2, 3], 0.5, 1.0, 1.0, [1.0, 2.0, -3.5, -1.0, 0.0, 3.0]),  # -1 - 2*1 - .5 ; .5 - 1 - .5
        ([], [5, 5, 5], 0.0, 0.5, 1.0, [1.0, 2.0, -1.0, 0.5, 0.0, 1.5]),  # frequency only: 3 - 3*.5
        ([], [5, 5, 5], 0.7, 0.0, 1.0, [1.0, 2.0, -1.0, 0.5, 0.0, 2.3]),  # presence only: once, whatever the count
        ([], [4, 1], 1.0, 0.25, 1.0, [1.0, 0.75, -1.0, 0.5, -1.25, 3.0]),
        ([], [0, 2, 0], -1.0, -0.5, 1.0, [3.0, 2.0, 0.5, 0.5, 0.0, 3.0]),  # negative: 1 + 1 + 1 ; -1 + .5 + 1
        ([0], [2, 2], 0.5, 1.0, 2.0, [0.5, 2.0, -4.5, 0.5, 0.0, 3.0]),  # repetition first: -1*2 = -2, -2 - 2 - .5
        ([1, 3], [1], 1.0, 1.0, 2.0, [1.0, -1.0, -1.0, 0.25, 0.0, 3.0]),  # 2/2 - 1 - 1 ; prompt 3: only 0.5/2
    ],
)
def test_openai_penalties_table(prefix, generated, presence, frequency, repetition, expected):
    v = len(_RAW6)
    assert _penalised_reference(_RAW6, prefix, generated, presence, frequency, repetition).tolist() == expected
    search = SamplingSearch(10, None, temperature=0.0, prefix=prefix, presence_penalty=presence,
                            frequency_penalty=frequency, repetition_penalty=repetition)
    _force(search, generated, v)
    np.testing.assert_allclose(search.process_logits(np.array(_RAW6)), expected, rtol=0, atol=1e-12)
    assert search.generated.tolist() == generated


def test_apply_openai_penalties_function():
    counts = np.array([[0, 1, 3], [2, 0, 0]])
    x = np.zeros((2, 3))
    np.testing.assert_allclose(apply_openai_penalties(x, counts, 0.5, 0.25), [[0, -0.75, -1.25], [-1.0, 0, 0]])
    np.testing.assert_array_equal(apply_openai_penalties(np.array([-np.inf, 1.0]), np.array([4, 0]), -2, -2),
                                  [-np.inf, 1.0])


@pytest.mark.parametrize("seed", range(6))
def test_openai_penalties_counts_are_maintained_incrementally(seed):
    """Over a sampled run on a tiny vocabulary (many repeats), each step's processed logits equal the reference
    recomputed from scratch over the generated tokens (prompt excluded)."""
    v = 6
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, v, size=4).tolist()
    presence, frequency = float(rng.uniform(-2, 2)), float(rng.uniform(-2, 2))
    repetition, temperature = float(rng.uniform(0.7, 1.5)), float(rng.uniform(0.5, 2.0))
    search = SamplingSearch(25, None, temperature=temperature, repetition_penalty=repetition, seed=seed,
                            prefix=prefix, presence_penalty=presence, frequency_penalty=frequency)
    while not search.done:
        raw = rng.standard_normal(v)
        expected = _penalised_reference(raw, prefix, search.generated.tolist(), presence, frequency, repetition,
                                        temperature)
        np.testing.assert_allclose(search.process_logits(raw), expected, rtol=1e-12, atol=1e-12)
        search.step(raw[None, :])
    gen = search.generated.tolist()
    assert len(gen) == 25 and len(set(gen)) < len(gen)
    np.testing.assert_array_equal(search._counts, np.bincount(gen, minlength=v))  # prefix not counted


def _fixed_logits_sequence(steps: int) -> list[np.ndarray]:
    """Rows favouring the same few tokens at every step (a greedy decoder repeats itself on them)."""
    rng = np.random.default_rng(3)
    base = np.linspace(5.0, 3.5, V)  # 0.1 apart: a penalty of 2 drops a token below the 9 next ones
    base[EOS] = -10.0
    return [(base + rng.uniform(0, 0.05, V)).astype(np.float32) for _ in range(steps)]


def _run_rows(search, rows) -> list[int]:
    for row in rows:
        if search.step(row[None, :]).done:
            break
    return search.results()[0].tokens


@pytest.mark.parametrize(("presence", "frequency"), [(0.0, 2.0), (2.0, 0.0), (1.0, 1.5)])
def test_strong_penalty_greedy_never_repeats(presence, frequency):
    rows = _fixed_logits_sequence(8)
    plain = _run_rows(SamplingSearch(8, EOS, temperature=0.0), rows)
    assert plain == _run_rows(GreedySearch(8, EOS), rows)  # penalties at 0: plain greedy
    assert len(set(plain)) < len(plain)  # unpenalised greedy repeats
    penalised = _run_rows(SamplingSearch(8, EOS, temperature=0.0, presence_penalty=presence,
                                         frequency_penalty=frequency, logprobs=1), rows)
    assert len(penalised) == 8 and len(set(penalised)) == 8
    # the prompt does not count: a prefix holding the favourite token still lets it be generated first
    first = _run_rows(SamplingSearch(1, EOS, temperature=0.0, frequency_penalty=2.0, prefix=[plain[0]]), rows)
    assert first == [plain[0]]


@pytest.mark.parametrize(("presence", "frequency"), [(0.0, -1.0), (-1.0, 0.0), (-0.5, -0.5)])
def test_negative_penalties_encourage_repetition(presence, frequency):
    first = np.full(V, -2.0, dtype=np.float32)
    first[4] = 5.0
    later = np.full(V, -2.0, dtype=np.float32)
    later[4], later[6] = 3.0, 3.5  # 6 wins unpenalised; a bonus of 1 for the already generated 4 flips it
    rows = [first] + [later] * 5
    assert _run_rows(SamplingSearch(6, EOS, temperature=0.0), rows) == [4, 6, 6, 6, 6, 6]
    got = _run_rows(SamplingSearch(6, EOS, temperature=0.0, presence_penalty=presence, frequency_penalty=frequency),
                    rows)
    assert got == [4] * 6


@pytest.mark.parametrize(
    "kw",
    [dict(presence_penalty=2.01), dict(presence_penalty=-2.5), dict(presence_penalty=float("nan")),
     dict(frequency_penalty=3.0), dict(frequency_penalty=-2.0001), dict(frequency_penalty=float("nan"))],
)
def test_openai_penalties_reject_out_of_range(kw):
    with pytest.raises(ValueError):
        SamplingSearch(5, EOS, **kw)


def test_openai_penalties_accept_the_bounds():
    for value in (-2.0, 2.0, 0.0):
        SamplingSearch(5, EOS, presence_penalty=value, frequency_penalty=value)


def test_zero_penalties_leave_processing_untouched():
    x = np.random.default_rng(4).standard_normal(V) * 3
    a = SamplingSearch(5, EOS, temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.3, prefix=[2, 3])
    b = SamplingSearch(5, EOS, temperature=0.8, top_k=5, top_p=0.9, repetition_penalty=1.3, prefix=[2, 3],
                       presence_penalty=0.0, frequency_penalty=0.0)
    np.testing.assert_array_equal(a.process_logits(x), b.process_logits(x))
    assert b._counts is None  # off: no counting at all
    seen = np.zeros(V, dtype=bool)
    seen[[2, 3]] = True  # the HF chain, unchanged: repetition penalty, temperature, top-k, top-p
    hf_chain = top_p_filter(top_k_filter(apply_temperature(apply_repetition_penalty(x, seen, 1.3), 0.8), 5), 0.9)
    np.testing.assert_array_equal(b.process_logits(x), hf_chain)


# --- distributions: the one copy of log-softmax, softmax and top-k ------------------------------------------------


def test_log_normaliser_is_log_softmax_bit_for_bit():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 40)) * 7
    x[1, :10] = -np.inf
    peak, log_z = log_normaliser(x)
    np.testing.assert_array_equal((x - peak[:, None]) - log_z[:, None], log_softmax(x))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_log_normaliser_in_row_chunks_on_threads_is_the_same_bit_for_bit(monkeypatch, dtype):
    import service.decoding.distributions as distributions

    rng = np.random.default_rng(5)
    x = (rng.standard_normal((37, 300)) * 6).astype(dtype)
    x[4, :50] = -np.inf
    x[9] = -np.inf  # a row with no finite max
    alone = [distributions._log_normaliser(x[r : r + 1]) for r in range(x.shape[0])]
    threads = []
    real = distributions._log_normaliser
    monkeypatch.setattr(distributions, "_log_normaliser", lambda part: threads.append(part.shape[0]) or real(part))
    monkeypatch.setattr(distributions, "PARALLEL_CHUNK_ENTRIES", 1000)
    monkeypatch.setattr(distributions, "_normaliser_threads", lambda: 3)
    monkeypatch.setattr(distributions, "_pool", None)
    peak, log_z = log_normaliser(x)
    assert sorted(threads) == [12, 12, 13]  # three chunks of rows, two of them on the pool's threads
    np.testing.assert_array_equal(peak, np.concatenate([m for m, _ in alone]))
    np.testing.assert_array_equal(log_z, np.concatenate([z for _, z in alone]))
    with np.errstate(invalid="ignore"):  # the row of -inf: NaN both ways
        np.testing.assert_array_equal((x.astype(np.float64) - peak[:, None]) - log_z[:, None], log_softmax(x))
    threads.clear()
    log_normaliser(x[:, :20])  # fewer entries than two chunks' worth: on the calling thread, whole
    assert threads == [37]


def test_softmax_keeps_the_dtype_and_is_the_classic_formula():
    x = np.random.default_rng(4).standard_normal((3, 11)).astype(np.float32) * 5
    e = np.exp(x - x.max(axis=1, keepdims=True))
    got = softmax(x)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, e / e.sum(axis=1, keepdims=True))


@pytest.mark.parametrize("k", [0, 1, 3, 7, 30, 31, 50])
def test_top_k_indices_is_a_stable_sort_of_minus_the_scores(k):
    rng = np.random.default_rng(k)
    for _ in range(50):
        row = rng.integers(-3, 4, size=31).astype(np.float64)  # many ties, at the boundary too
        row[rng.integers(0, 31, size=3)] = -np.inf
        expected = np.argsort(-row, kind="stable")[:k]
        np.testing.assert_array_equal(top_k_indices(row, k), expected)
        rows = np.stack([row, row[::-1]])
        np.testing.assert_array_equal(top_k_indices(rows, k), np.argsort(-rows, axis=1, kind="stable")[:, :k])


CHILD_TIMEOUT_S = 20


def test_log_normaliser_after_fork_starts_its_own_threads(monkeypatch):
    import service.decoding.distributions as distributions

    monkeypatch.setattr(distributions, "PARALLEL_CHUNK_ENTRIES", 1000)
    monkeypatch.setattr(distributions, "_normaliser_threads", lambda: 2)
    x = np.random.default_rng(6).standard_normal((8, 500))
    expected = log_normaliser(x)  # the parent's pool now has a thread
    child = os.fork()
    if child == 0:  # the child: the parent's thread is gone; a chunk handed to it would never come back
        signal.alarm(CHILD_TIMEOUT_S)  # a hang ends the child with SIGALRM, which fails the test
        code = 1
        try:
            got = log_normaliser(x)
            code = 0 if all(np.array_equal(a, b) for a, b in zip(got, expected)) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
