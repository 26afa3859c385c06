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


def test_single_row_searches_continue_their_own_rows_as_the_others_finish():
    """Greedy searches that end at different steps (`run_search`'s single-row loop): each step's rows are the
    searches still running, in order, each continuing its own row of the previous call (parents) with its own last
    token; a beam search among them takes the general loop, with the same rows."""
    lengths = [1, 4, 2, 3]
    calls = []

    def recording_step_fn(tokens, parents):
        calls.append((np.asarray(tokens).tolist(), np.asarray(parents).tolist()))
        return step_fn(tokens, parents)

    first = np.zeros((len(lengths), V))
    first[np.arange(len(lengths)), [1, 2, 3, 4]] = 3.0
    searches = [GreedySearch(max_new_tokens=n, eos_token_id=0) for n in lengths]
    run_search(searches, first, recording_step_fn)
    assert [s.results()[0].tokens for s in searches] == [[1], [2, 3, 4, 1], [3, 4], [4, 1, 2]]
    # step 1: searches 1-3 (search 0 ended on the prefill), from prefill rows 1, 2, 3; step 2: searches 1 and 3,
    # rows 0 and 2 of step 1; step 3: search 1 alone, row 0 of step 2
    assert calls == [([2, 3, 4], [1, 2, 3]), ([3, 1], [0, 2]), ([4], [0])]
    mixed = [GreedySearch(max_new_tokens=n, eos_token_id=0) for n in lengths]
    beam_calls, general = [], calls
    calls = beam_calls
    run_search(mixed + [BeamSearch(num_beams=1, max_new_tokens=1, eos_token_id=0)],
               np.concatenate([first, first[:1]]), recording_step_fn)
    assert [s.results()[0].tokens for s in mixed] == [[1], [2, 3, 4, 1], [3, 4], [4, 1, 2]]
    assert beam_calls == general  # the beam search ended on the prefill: the same rows as the single-row loop
