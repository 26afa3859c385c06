"""The batched sampler's rows and its draw (`service.decoding.sampler`), table-style: each row gets its own
parameters in a mixed batch, a sampling row takes the inverse CDF of its softmax at its own uniform draw (the exact
token for a given draw, the boundaries included), a row whose every token was removed draws nothing, and the top
of the CDF never lands on a removed token. Draws are fixed numbers (`Draw`), so every expectation is exact."""

from __future__ import annotations

import numpy as np
import pytest

from service.decoding.processors import top_p_filter
from service.decoding.sampler import RowParams, choose, process

NEG = -np.inf


class Draw:
    """A generator whose `random()` returns the given numbers in turn, counting the draws."""

    def __init__(self, *values: float):
        self.values, self.draws = list(values), 0

    def random(self) -> float:
        self.draws += 1
        return self.values.pop(0)


def rows(n: int, v: int, **fields) -> RowParams:
    """n rows of vocabulary v: greedy and without any filter or penalty unless `fields` say otherwise."""
    base = dict(temperature=np.zeros(n), top_k=np.zeros(n, np.int64), top_p=np.ones(n),
                repetition_penalty=np.ones(n), presence_penalty=np.zeros(n), frequency_penalty=np.zeros(n),
                seen=[None] * n, counts=[None] * n, banned=np.zeros((n, v), bool), generators=[None] * n)
    for name, value in fields.items():
        base[name] = np.asarray(value) if name in ("temperature", "top_k", "top_p") else value
    return RowParams(**base)


@pytest.mark.parametrize("draw, token", [
    (0.0, 0), (0.2499, 0), (0.25, 1), (0.4999, 1), (0.5, 2), (0.74, 2), (0.75, 3), (0.9999, 3)])
def test_four_equal_tokens_the_draw_picks_the_inverse_cdf(draw, token):
    """Equal logits: token floor(4 * draw); a draw exactly on a boundary takes the next token (side="right")."""
    logits = np.zeros((1, 4))
    assert choose(logits, rows(1, 4, temperature=[1.0], generators=[Draw(draw)])).tolist() == [token]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
def test_any_positive_temperature_samples(temperature):
    """Token 0 is the less likely one; a low draw takes it at every temperature > 0 (argmax would take token 1)."""
    logits = np.array([[0.0, 0.5]])
    assert choose(logits, rows(1, 2, temperature=[temperature], generators=[Draw(0.01)])).tolist() == [0]


def test_unnormalised_probabilities_scale_the_draw():
    """Two tokens of probability 1/4 and 3/4: a draw of 0.3 is past the first quarter."""
    logits = np.array([[0.0, np.log(3.0)]])
    assert choose(logits, rows(1, 2, temperature=[1.0], generators=[Draw(0.3)])).tolist() == [1]
    assert choose(np.array([[0.0, np.log(3.0)]]), rows(1, 2, temperature=[1.0], generators=[Draw(0.2)])).tolist() \
        == [0]


@pytest.mark.parametrize("logits, token", [
    ([0.0, NEG, 0.0], 2),           # the top of the CDF is the last live token
    ([0.0, 0.0, NEG, 0.0], 3),
    ([0.0, 0.0, 0.0, NEG], 2),      # never the removed last token
])
def test_the_top_of_the_cdf_takes_the_last_live_token(logits, token):
    """A draw at the very top (float rounding can put it there): the last token still in play."""
    x = np.array([logits])
    assert choose(x, rows(1, x.shape[1], temperature=[1.0], generators=[Draw(1.0)])).tolist() == [token]


def test_a_row_with_every_token_removed_takes_its_argmax_and_draws_nothing():
    banned = np.array([[True, True, True], [False, False, False]])
    dead, live = Draw(0.5), Draw(0.9)
    tokens = choose(np.zeros((2, 3)), rows(2, 3, temperature=[1.0, 1.0], banned=banned, generators=[dead, live]))
    assert tokens.tolist() == [0, 2]
    assert (dead.draws, live.draws) == (0, 1)


def test_each_row_keeps_its_own_filters_in_a_mixed_batch():
    """Row 0 samples with top_k=1, row 1 samples with top_k off, row 2 with top_p 0.5, row 3 is greedy."""
    x = np.tile(np.log(np.array([0.1, 0.2, 0.3, 0.4])), (4, 1))
    out = process(x.copy(), rows(4, 4, temperature=[1.0, 1.0, 1.0, 0.0], top_k=[1, 0, 0, 1],
                                 top_p=[1.0, 1.0, 0.5, 1.0]))
    assert np.isneginf(out[0]).tolist() == [True, True, True, False]
    np.testing.assert_array_equal(out[1], x[1])
    assert np.isneginf(out[2]).tolist() == [True, True, False, False]  # 0.4 + 0.3 reaches 0.5
    np.testing.assert_array_equal(out[3], x[3])  # greedy rows are not warped: their argmax is the answer


def test_top_p_keeps_the_smallest_set_that_reaches_it_exactly():
    """Four equal tokens, top_p 0.75: three of them reach it exactly; the first (stable order) is dropped."""
    out = top_p_filter(np.zeros(4), 0.75)
    assert np.isneginf(out).tolist() == [True, False, False, False]


def test_top_p_is_stable_for_large_logits():
    """Logits far from 0 (no overflow: the softmax is taken relative to the largest)."""
    out = top_p_filter(np.array([1000.0, 1000.0 + np.log(3.0)]), 0.7)
    assert np.isneginf(out).tolist() == [True, False]
    out = top_p_filter(np.array([-1000.0, -1000.0 + np.log(3.0)]), 0.8)
    assert not np.isneginf(out).any()


def test_top_p_drops_tied_tokens_lowest_id_first():
    """Ties at the nucleus boundary are broken by id, the same on every run and machine (a stable sort): of 42
    equally likely low tokens, the 20 lowest ids are dropped."""
    x = np.zeros(64)
    x[::3] = 1.0  # 22 high tokens, 42 low ones
    low = np.flatnonzero(x == 0.0)
    p_low = 1.0 / (22 * np.e + 42)
    out = top_p_filter(x, 1.0 - 20.5 * p_low)
    assert np.flatnonzero(np.isneginf(out)).tolist() == low[:20].tolist()
