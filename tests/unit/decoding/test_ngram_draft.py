"""The n-gram drafter (`service.decoding.ngram_draft`): exact drafts on constructed contexts (the longest n-gram
first, its most recent occurrence, a period repeated past the context's end), the incremental index against a
rescan, the adaptive draft length and the pause of a row whose drafts are rejected."""

from __future__ import annotations

import random

import pytest

from service.decoding.ngram_draft import FIRST_DRAFT, GROW, NGramDrafter


def rescan(context: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The reference: scan the whole context for the longest n-gram ending it that occurred earlier, latest wins."""
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        suffix = context[-n:]
        for end in range(len(context) - 2, n - 2, -1):
            if context[end - n + 1 : end + 1] == suffix:
                seq, draft = context, []
                for j in range(k):
                    at = end + 1 + j
                    draft.append(seq[at] if at < len(seq) else draft[at - len(seq)])
                return draft
    return []


@pytest.mark.parametrize(("context", "k", "draft"), [
    ([1, 2, 3, 9, 9, 1, 2, 3], 3, [9, 9, 1]),  # the trigram 1 2 3 occurred at the start
    ([1, 2, 3, 4, 5, 6, 2, 3], 2, [4, 5]),  # the bigram 2 3
    ([5, 1, 2, 7, 3, 1, 2, 8, 1, 2], 1, [8]),  # 1 2 occurred twice: the most recent wins
    ([1, 2, 3, 7, 5, 2, 3, 8, 1, 2, 3], 1, [7]),  # 2 3 last led to 8, but the longer 1 2 3 (to 7) wins
    ([1, 2, 1, 2, 1, 2], 5, [1, 2, 1, 2, 1]),  # a period: the copy goes on with itself past the end
    ([1, 2, 3, 4], 3, []),  # nothing repeats
    ([7], 3, []),  # too short to match
])
def test_drafts_follow_the_most_recent_longest_match(context, k, draft):
    drafter = NGramDrafter(context, max_n=3, min_n=2, max_draft=k)
    drafter.draft_length = k
    assert drafter.propose() == draft


def test_min_n_ignores_shorter_matches_and_limit_caps_the_draft():
    drafter = NGramDrafter([1, 2, 5, 6, 7, 1, 2], max_n=4, min_n=3, max_draft=8)
    assert drafter.propose() == []  # the bigram 1 2 repeats, no trigram does
    drafter = NGramDrafter([1, 2, 5, 6, 7, 1, 2], max_n=4, min_n=2, max_draft=8)
    drafter.draft_length = 8
    assert drafter.propose(limit=2) == [5, 6]
    assert drafter.propose(limit=0) == []


@pytest.mark.parametrize("seed", range(5))
def test_the_incremental_index_drafts_what_a_rescan_drafts(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(300)]
    drafter = NGramDrafter(tokens[:5], max_n=5, min_n=2, max_draft=6)
    drafter.draft_length = 6
    at = 5
    while at < len(tokens):
        step = rng.randint(1, 4)
        drafter.extend(tokens[at : at + step])  # grows by a few tokens at a time, as accepted drafts come in
        at += step
        assert len(drafter) == min(at, len(tokens))
        assert drafter.propose() == rescan(tokens[:at], 6, 5, 2)


def test_the_draft_length_grows_while_every_token_is_accepted_and_falls_to_the_accepted_run():
    drafter = NGramDrafter([1, 2, 3, 1, 2], min_n=2, max_draft=7, min_acceptance=0.0)
    assert drafter.draft_length == FIRST_DRAFT
    drafter.record(FIRST_DRAFT, FIRST_DRAFT)
    assert drafter.draft_length == FIRST_DRAFT + GROW
    drafter.record(4, 4)
    drafter.record(6, 6)
    assert drafter.draft_length == 7  # up to max_draft
    drafter.record(7, 2)
    assert drafter.draft_length == 3  # the accepted run plus one
    drafter.record(3, 0)
    assert drafter.draft_length == 1
    assert len(drafter.propose()) == 1


def test_a_row_whose_drafts_are_rejected_pauses_then_tries_again():
    drafter = NGramDrafter([1, 2, 3, 1, 2], min_n=2, max_draft=4, window=8, min_acceptance=0.5, pause=3)
    drafter.record(4, 1)
    assert not drafter.paused  # the window is not full yet
    assert drafter.acceptance == 0.25
    drafter.record(4, 1)  # 2 of 8: below the threshold
    assert drafter.paused and drafter.acceptance is None
    assert [drafter.propose() for _ in range(3)] == [[], [], []]
    assert not drafter.paused
    assert drafter.propose() == [3, 1][: drafter.draft_length]  # drafting again, from the first length


def test_a_row_that_fails_again_pauses_twice_as_long_up_to_a_bound_and_a_good_window_resets_it():
    drafter = NGramDrafter([1, 2, 3, 1, 2], min_n=2, max_draft=4, window=4, min_acceptance=0.5, pause=2, max_pause=6)

    def pause_after(accepted: int) -> int:
        drafter.record(4, accepted)
        steps = 0
        while drafter.paused:
            assert drafter.propose() == []
            steps += 1
        return steps

    assert [pause_after(0) for _ in range(4)] == [2, 4, 6, 6]
    assert pause_after(4) == 0  # a good window
    assert pause_after(0) == 2


def test_a_row_above_the_threshold_keeps_drafting_over_a_sliding_window():
    drafter = NGramDrafter([1, 2, 3, 1, 2], min_n=2, max_draft=4, window=8, min_acceptance=0.5, pause=3)
    for _ in range(10):
        drafter.record(4, 4)
    drafter.record(4, 0)  # the window holds the latest drafts only: 4 of 8
    assert not drafter.paused and drafter.acceptance == 0.5
    drafter.record(4, 0)
    assert drafter.paused


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        NGramDrafter(min_n=3, max_n=2)
    with pytest.raises(ValueError):
        NGramDrafter(max_draft=0)
    with pytest.raises(ValueError):
        NGramDrafter().record(2, 3)


def test_the_bounds_of_its_settings_are_checked_with_their_names():
    assert NGramDrafter(min_n=1, max_n=1).min_n == 1
    assert NGramDrafter(min_n=3, max_n=3, max_draft=1).draft_length == 1
    for bad in ({"min_n": 0, "max_n": 2}, {"min_n": 3, "max_n": 2}):
        with pytest.raises(ValueError, match=r"^need 1 <= min_n <= max_n$"):
            NGramDrafter(**bad)
    with pytest.raises(ValueError, match=r"^max_draft must be >= 1$"):
        NGramDrafter(max_draft=0)
    drafter = NGramDrafter()
    with pytest.raises(ValueError, match=r"^accepted 3 of 2 drafted tokens$"):
        drafter.record(2, 3)
    with pytest.raises(ValueError, match=r"^accepted -1 of 1 drafted tokens$"):
        drafter.record(1, -1)


def test_a_one_token_draft_counts_and_an_empty_one_does_not():
    drafter = NGramDrafter(min_n=1, max_n=2, window=2, min_acceptance=0.5, pause=3)
    drafter.record(0, 0)
    assert drafter.acceptance is None and drafter.draft_length == 2
    drafter.record(1, 1)
    assert drafter.acceptance == 1.0 and drafter.draft_length == 4
    drafter.record(1, 0)  # the window of 2 draft tokens is half accepted: enough
    assert not drafter.paused and drafter.draft_length == 1


def test_unigrams_and_the_shortest_contexts_are_looked_up_exactly():
    drafter = NGramDrafter([7, 1, 2, 7], min_n=1, max_n=3, max_draft=4)
    # the context ends in 7, whose last earlier occurrence ended at 0: [1, 2] follow, then the loop goes on
    assert drafter.propose(4) == [1, 2]  # the first draft holds two tokens
    short = NGramDrafter([5, 5], min_n=1, max_n=8)
    assert short.propose(3) == [5, 5]  # the 1-gram [5] ended at 0; the first draft holds two tokens
    assert NGramDrafter([5], min_n=1).propose(3) == []  # nothing before the last token
    exact = NGramDrafter([1, 2, 3, 9, 1, 2, 3], min_n=3, max_n=3)
    assert exact.propose(2) == [9, 1]
    assert NGramDrafter([1, 2, 3], min_n=3, max_n=3).propose(2) == []  # as long as min_n: nothing earlier
    grown = NGramDrafter([4, 1, 2], min_n=2, max_n=2)
    grown.extend([3, 1, 2])
    assert grown.propose(2) == [3, 1] and len(grown) == 6
    grown.extend([])
    assert grown.propose(2) == [3, 1]
