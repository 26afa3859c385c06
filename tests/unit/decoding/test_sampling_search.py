"""`SamplingSearch`'s contract beyond the golden outputs: invalid parameters are refused naming the parameter, the
defaults are transformers' (temperature 1, no filter, no minimum length), misuse (a batch of logits for one row,
results before the end, a step after it) is an error that says so, and `step_single_rows(isolate=True)` confines a
failing request to its own row, whether it fails in its own bookkeeping or in the batch's shared array work."""

from __future__ import annotations

import numpy as np
import pytest

from service.decoding import SamplingSearch
from service.decoding.sampling import step_single_rows

V = 6


@pytest.mark.parametrize("fields, message", [
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size must be >= 0"),
    ({"logprobs": -1}, "logprobs must be None or >= 0"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_k": -1}, "top_k must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"presence_penalty": -2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": 2.5}, r"frequency_penalty must be in \[-2, 2\]"),
])
def test_invalid_parameters_are_refused_naming_the_parameter(fields, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        SamplingSearch(**{"max_new_tokens": 4, "eos_token_id": 0, **fields})


@pytest.mark.parametrize("fields", [{"top_p": 1.0}, {"presence_penalty": 2.0}, {"frequency_penalty": -2.0},
                                    {"logprobs": 0}, {"temperature": 0.0}, {"top_k": 0}])
def test_the_bounds_themselves_are_accepted(fields):
    SamplingSearch(max_new_tokens=1, eos_token_id=0, **fields)


def test_defaults_are_transformers():
    search = SamplingSearch(max_new_tokens=3, eos_token_id=0)
    assert (search.temperature, search.top_k, search.top_p, search.repetition_penalty) == (1.0, 0, 1.0, 1.0)
    assert (search.min_new_tokens, search.no_repeat_ngram_size, search.logprobs) == (0, 0, None)
    # no minimum length: EOS may end the sequence at once
    search = SamplingSearch(max_new_tokens=3, eos_token_id=0, temperature=0)
    search.step(np.array([[5.0, 0, 0, 0, 0, 0]]))
    assert search.done and search.results()[0].finish_reason == "eos"


def test_step_takes_one_row_of_logits():
    search = SamplingSearch(max_new_tokens=3, eos_token_id=0, temperature=0)
    with pytest.raises(ValueError, match=r"^expected logits of shape \(1, V\), got \(2, 6\)$"):
        search.step(np.zeros((2, V)))


def test_results_only_at_the_end_and_no_step_after_it():
    search = SamplingSearch(max_new_tokens=1, eos_token_id=0, temperature=0)
    with pytest.raises(RuntimeError, match=r"^results\(\) before the search is done$"):
        search.results()
    search.step(np.array([[0, 0, 3.0, 0, 0, 0]]))
    assert search.results()[0].tokens == [2]
    with pytest.raises(RuntimeError, match=r"^step\(\) called on a finished search$"):
        step_single_rows([search], np.zeros((1, V)))
    with pytest.raises(ValueError, match=r"^expected logits of shape \(2, V\), got \(1, 6\)$"):
        step_single_rows([search, search], np.zeros((1, V)))


def test_the_repetition_penalty_ignores_prefix_ids_outside_the_vocabulary():
    search = SamplingSearch(max_new_tokens=2, eos_token_id=0, temperature=0, repetition_penalty=2.0,
                            prefix=[1, -1, V, V + 3])
    assert search.seen_tokens(V).tolist() == [False, True, False, False, False, False]


def _greedy(**fields) -> SamplingSearch:
    return SamplingSearch(max_new_tokens=4, eos_token_id=0, temperature=0, **fields)


class BrokenGenerator:
    def random(self):
        raise FloatingPointError("broken generator")


def _fail(_tokens):
    raise KeyError("stop checker failed")


LOGITS = np.array([[0, 1.0, 3.0, 0, 0, 0], [0, 0, 0, 4.0, 0, 0], [0, 0, 0, 0, 2.0, 0]])


def test_a_failure_in_accepting_a_token_stays_in_its_row():
    searches = [_greedy(), _greedy(stop_checker=_fail), _greedy()]
    out = step_single_rows(searches, LOGITS, isolate=True)
    assert isinstance(out[1], KeyError)
    assert [o.tokens.tolist() for o in (out[0], out[2])] == [[2], [4]]
    assert [s.generated.tolist() for s in (searches[0], searches[2])] == [[2], [4]]


def test_a_failure_in_the_shared_work_is_retried_row_by_row():
    broken = SamplingSearch(max_new_tokens=4, eos_token_id=0, temperature=1.0, seed=0)
    broken.generator = BrokenGenerator()
    searches = [_greedy(), broken, _greedy()]
    out = step_single_rows(searches, LOGITS, isolate=True)
    assert isinstance(out[1], FloatingPointError)
    assert [o.tokens.tolist() for o in (out[0], out[2])] == [[2], [4]]
    assert [s.generated.tolist() for s in (searches[0], searches[2])] == [[2], [4]]


def test_without_isolation_the_first_failure_propagates():
    searches = [_greedy(), _greedy(stop_checker=_fail)]
    with pytest.raises(KeyError):
        step_single_rows(searches, LOGITS[:2])
    broken = SamplingSearch(max_new_tokens=4, eos_token_id=0, temperature=1.0, seed=0)
    broken.generator = BrokenGenerator()
    with pytest.raises(FloatingPointError):  # alone, isolated or not: nothing to retry
        step_single_rows([broken], LOGITS[:1], isolate=True)


@pytest.mark.parametrize("temperature", [1e-6, 1e-300])
def test_a_temperature_below_1e_5_is_greedy(temperature):
    """vLLM's rule: logits / 1e-300 would overflow to inf and NaN; such a request decodes greedily."""
    search = SamplingSearch(max_new_tokens=2, eos_token_id=0, temperature=temperature, seed=0)
    assert search.temperature == 0.0
    search.step(np.array([[0, 1.0, 1.5, 0, 0, 0]]))
    assert search.generated.tolist() == [2]


def _mixed_searches() -> list[SamplingSearch]:
    """Rows of every kind `step_single_rows` meets: plain greedy (not processed), greedy with a ban (processed
    while it applies), seeded sampling with penalties and top-k/top-p, each recording log-probabilities."""
    return [SamplingSearch(max_new_tokens=8, eos_token_id=0, temperature=0.0, logprobs=3),
            SamplingSearch(max_new_tokens=8, eos_token_id=0, temperature=0.0, min_new_tokens=4,
                           no_repeat_ngram_size=2, logprobs=2),
            SamplingSearch(max_new_tokens=8, eos_token_id=0, temperature=0.8, top_k=40, top_p=0.9,
                           repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4, seed=7, logprobs=5)]


def test_float32_logits_decode_exactly_as_their_float64_values():
    """The searches read the engines' float32 logits as they are (no float64 copy of rows that are not processed):
    tokens, scores and every recorded log-probability are bit for bit those of the same values given in float64."""
    rng = np.random.default_rng(0)
    steps = (rng.standard_normal((8, 3, 257)) * 4).astype(np.float32)
    steps[:, :, 17] = steps[:, :, 5]  # ties, which the top alternatives break by lower id
    outcomes = []
    for dtype in (np.float32, np.float64):
        searches = _mixed_searches()
        for logits in steps:
            live = [s for s in searches if not s.done]
            step_single_rows(live, logits[[i for i, s in enumerate(searches) if not s.done]].astype(dtype))
        outcomes.append([(h.tokens, h.score, [(t.token_id, t.logprob, t.top) for t in h.logprobs])
                         for s in searches for h in s.results()])
    assert outcomes[0] == outcomes[1]
    assert all(isinstance(lp, float) for _, _, records in outcomes[0] for _, lp, _ in records)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_greedy_rows_with_only_bans_choose_what_the_sampler_chooses(dtype):
    """Greedy rows whose only processing is a ban (min_new_tokens' EOS, the n-gram ban) take a shortcut around the
    batched sampler: the same tokens, steps and scores as through it, beside rows that go through it."""
    from service.decoding import sampler
    from service.decoding.sampling import row_params

    rng = np.random.default_rng(7)
    vocab, steps = 24, 12

    def make():
        return [SamplingSearch(steps, 3, temperature=0.0, min_new_tokens=6),
                SamplingSearch(steps, [3, 5], temperature=0.0, no_repeat_ngram_size=2, prefix=[1, 2, 1]),
                SamplingSearch(steps, 3, temperature=0.0, repetition_penalty=1.3, min_new_tokens=4),
                SamplingSearch(steps, 3, temperature=0.0)]

    fast, reference = make(), make()
    for _ in range(steps):
        live = [i for i, s in enumerate(fast) if not s.done]
        if not live:
            break
        logits = rng.normal(size=(len(live), vocab)).astype(dtype)
        logits[:, 3] += 2.0  # EOS often the most likely: the ban decides
        logits[:, 7] = logits[:, 8]  # a tie, taken by the lower id
        step_single_rows([fast[i] for i in live], logits)
        for row, i in enumerate(live):  # the reference: every row through the sampler, one at a time
            search = reference[i]
            x = logits[row : row + 1].astype(np.float64)
            token = int(sampler.choose(x.copy(), row_params([search], vocab))[0])
            log_probs = x[0] - x[0].max() - np.log(np.exp(x[0] - x[0].max()).sum())
            search.accept(token, float(log_probs[token]), [])
    for got, want in zip(fast, reference):
        assert got.done and want.done
        assert got.results()[0].tokens == want.results()[0].tokens
        assert got.results()[0].score == pytest.approx(want.results()[0].score, abs=1e-9)


def test_bans_says_what_mask_banned_masks():
    """`bans(token)` (the greedy shortcut's check of its raw choice) agrees with `mask_banned` on every token, at
    every step: EOS before `min_new_tokens`, the n-gram ban, both, neither."""
    rng = np.random.default_rng(3)
    vocab = 12
    searches = [SamplingSearch(10, [3, 5], temperature=0.0, min_new_tokens=4, no_repeat_ngram_size=2,
                               prefix=[1, 2, 1]),
                SamplingSearch(10, 3, temperature=0.0, min_new_tokens=6),
                SamplingSearch(10, 3, temperature=0.0, no_repeat_ngram_size=1)]
    checked = 0
    for _ in range(8):
        for search in searches:
            if search.done:
                continue
            mask = np.zeros(vocab, dtype=bool)
            search.mask_banned(mask)
            assert [search.bans(t) for t in range(vocab)] == mask.tolist()
            checked += int(mask.any())
            allowed = np.flatnonzero(~mask)
            search.accept(int(rng.choice(allowed)), -1.0, [])
    assert checked  # some steps did ban something
