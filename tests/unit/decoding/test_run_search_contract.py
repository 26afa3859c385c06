"""`run_search`, the offline driver, at its edges: prefill logits given as (1, V) rows (what an engine's prefill
returns per request) decode as (V,) ones, and a mismatch between searches and logits, or a `step_fn` that returns
the wrong number of rows, is an error that says which."""

from __future__ import annotations

import numpy as np
import pytest

from service.decoding import BeamSearch, GreedySearch, run_search

V = 5


def step_fn(tokens, parents):
    """A model that wants the token after the one it just took (mod V), EOS (0) never."""
    logits = np.zeros((len(tokens), V))
    logits[np.arange(len(tokens)), (np.asarray(tokens) % (V - 1)) + 1] = 3.0
    return logits


@pytest.mark.parametrize("shape", [(V,), (1, V)])
def test_prefill_logits_as_rows_or_vectors(shape):
    first = np.zeros(V)
    first[2] = 3.0
    searches = [GreedySearch(max_new_tokens=4, eos_token_id=0), BeamSearch(num_beams=2, max_new_tokens=4,
                                                                           eos_token_id=0)]
    run_search(searches, [first.reshape(shape), first.reshape(shape)], step_fn)
    assert searches[0].results()[0].tokens == [2, 3, 4, 1]
    assert searches[1].results()[0].tokens == [2, 3, 4, 1]


def test_one_first_logits_entry_per_search():
    with pytest.raises(ValueError, match="^need one first_logits entry per search$"):
        run_search([GreedySearch(max_new_tokens=2, eos_token_id=0)], [np.zeros(V), np.zeros(V)], step_fn)


def test_a_step_fn_with_the_wrong_row_count_is_named():
    with pytest.raises(ValueError, match=r"^step_fn returned 3 rows, expected 2$"):
        run_search([GreedySearch(max_new_tokens=3, eos_token_id=0), GreedySearch(max_new_tokens=3, eos_token_id=0)],
                   [np.arange(V), np.arange(V)], lambda tokens, parents: np.zeros((3, V)))
