"""`NGramBlocker` at its edges: a size below 1 is refused, a prefix given as a 2-D array is one sequence in row
order, and ids outside the vocabulary (a padding id, an id past the logits) are never handed back to index logits
with (HF ignores them too)."""

from __future__ import annotations

import numpy as np
import pytest

from service.decoding.ngrams import NGramBlocker


def test_a_size_below_one_is_refused():
    with pytest.raises(ValueError, match="^n-gram size must be >= 1$"):
        NGramBlocker(0)


def test_a_2d_prefix_is_one_sequence_in_row_order():
    blocker = NGramBlocker(2, np.array([[1, 2], [3, 1]]))  # 1 2 3 1: after 1, 2 would repeat "1 2"
    assert blocker.banned() == {2}
    blocker.extend(np.array([[4]]))
    assert blocker.banned() == ()


def test_banned_ids_stay_inside_the_vocabulary():
    blocker = NGramBlocker(1, [2, 5, -1, 4])  # n = 1: every token seen so far is banned
    assert sorted(blocker.banned_ids(5).tolist()) == [2, 4]
    row = blocker.apply(np.zeros(5))
    assert np.isneginf(row).tolist() == [False, False, True, False, True]
