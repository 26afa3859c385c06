"""Unit tests of `service.decoding` on scripted logits and a toy history-dependent "model" (numpy only)."""

from __future__ import annotations

import numpy as np
import pytest

from service.decoding import (
    BeamSearch,
    GreedySearch,
    SamplingSearch,
    StopStrings,
    log_softmax,
    run_search,
    truncate_at_stop,
)
from service.decoding.base import NGramBlocker

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


def test_stop_strings_tail_window_sees_new_occurrences():
    checker = StopStrings(["xyz"], lambda ids: "".join("xyz"[i % 3] if i < 3 else "-" for i in ids), tail_tokens=3)
    assert checker(np.array([5, 5, 5, 0, 1, 2]))
    assert not checker(np.array([0, 1, 2, 5]))  # old occurrence outside the tail was caught earlier
    assert StopStrings(["xyz"], str, tail_tokens=None).tail_tokens is None


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
