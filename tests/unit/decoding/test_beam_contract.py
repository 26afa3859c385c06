"""`BeamSearch`'s contract beyond the golden outputs: invalid parameters and misuse are errors that say what is
wrong, and the bans hold on every beam: no hypothesis repeats an n-gram of `no_repeat_ngram_size`, none ends before
`min_new_tokens` (with one EOS id or several)."""

from __future__ import annotations

import numpy as np
import pytest

from service.decoding import BeamSearch

V = 8


@pytest.mark.parametrize("fields, message", [
    ({"num_beams": 0}, "num_beams must be >= 1"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
    ({"num_return_sequences": 3}, r"num_return_sequences must be in \[1, num_beams\]"),
    ({"num_return_sequences": 0}, r"num_return_sequences must be in \[1, num_beams\]"),
    ({"early_stopping": "always"}, 'early_stopping must be True, False or "never"'),
    ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size must be >= 0"),
])
def test_invalid_parameters_are_refused_naming_the_parameter(fields, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        BeamSearch(**{"num_beams": 2, "max_new_tokens": 4, "eos_token_id": 0, **fields})


def run(search: BeamSearch, logits_of) -> list:
    """Step the search with logits_of(row history) for each row until it is done; its hypotheses."""
    histories = [[]]
    while not search.done:
        out = search.step(np.stack([logits_of(h) for h in histories]))
        if out.done:
            break
        assert out.tokens.dtype == np.int64 and out.parents.dtype == np.int64  # fed to the graph's int64 inputs
        histories = [histories[p] + [int(t)] for p, t in zip(out.parents, out.tokens)]
    return search.results()


def repeating(history) -> np.ndarray:
    """A model that wants to say "3 4 3 4 ..." forever, EOS its least likely token."""
    logits = np.linspace(0.0, 1.0, V)
    logits[3 if not history or history[-1] == 4 else 4] += 5.0
    logits[0] = -5.0
    return logits


def test_no_beam_repeats_an_ngram():
    hypotheses = run(BeamSearch(num_beams=3, max_new_tokens=8, eos_token_id=0, no_repeat_ngram_size=2,
                                num_return_sequences=3), repeating)
    assert len(hypotheses) == 3
    for h in hypotheses:
        bigrams = list(zip(h.tokens, h.tokens[1:]))
        assert len(bigrams) == len(set(bigrams)), h.tokens
    assert all(np.isfinite(h.score) for h in hypotheses)


def eager(history) -> np.ndarray:
    """A model whose best tokens are its two EOS ids, always."""
    logits = np.zeros(V)
    logits[[0, 1]] = 4.0
    return logits


@pytest.mark.parametrize("eos", [0, [0, 1]])
def test_no_hypothesis_ends_before_min_new_tokens(eos):
    hypotheses = run(BeamSearch(num_beams=2, max_new_tokens=6, eos_token_id=eos, min_new_tokens=3,
                                num_return_sequences=2), eager)
    assert len(hypotheses) == 2
    assert all(len(h.tokens) >= 3 and np.isfinite(h.score) for h in hypotheses)
    assert hypotheses[0].finish_reason == "eos"


def test_misuse_is_an_error_that_says_so():
    search = BeamSearch(num_beams=2, max_new_tokens=1, eos_token_id=0)
    with pytest.raises(RuntimeError, match=r"^results\(\) before the search is done$"):
        search.results()
    with pytest.raises(ValueError, match=r"^expected logits of shape \(1, V\), got \(2, 8\)$"):
        search.step(np.zeros((2, V)))
    search.step(np.zeros((1, V)))
    assert search.done
    with pytest.raises(RuntimeError, match=r"^step\(\) called on a finished search$"):
        search.step(np.zeros((1, V)))
