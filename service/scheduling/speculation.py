"""Speculative decoding without a draft model, the batch's side: when a step may speculate, each row's n-gram draft
(`service.decoding.ngram_draft`), and the searches stepped over a verify pass's positions (`step_verified`).

A step speculates (`TextBatch.generate_token`) when `TSERVE_SPECULATION=ngram`, the engine can verify drafts over
its cache (`GPTEngine.speculates`), the batch holds at most `TSERVE_SPECULATION_MAX_ROWS` rows, every request in it
is a greedy single-row search (a sampled one would change its text with the load), and some row has a draft;
otherwise it is a plain step. Each row is fed its pending token and its draft in one pass
(`service.engines.speculation`); its search is then stepped on the logits of each fed position in turn, through the
same batched step as a plain one (`step_searches`: EOS, stop strings, max tokens, log-probabilities, constraints
all as in plain decoding), while the token it chooses is the next draft token: the agreeing prefix plus one token
is kept, the cache rolled back past the first disagreement. The rejection rule lives here alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from service.decoding import StepResult, step_searches
from service.decoding.ngram_draft import MAX_DRAFT, NGramDrafter
from service.scheduling.jobs import TextJob

__all__ = ["SpeculationConfig", "draft_for", "speculable", "step_verified"]

# Rows above which a step does not speculate (TSERVE_SPECULATION_MAX_ROWS' default): at 2, 4 and 8 streams of open
# Shakespeare continuation speculation lost (0.78-0.92x, 0.65-0.79x, 0.56-0.62x tokens/s; docs/speculation.md): a
# verify pass's cost grows with its rows times its tokens, and any row's draft makes every row pay it
MAX_ROWS = 1


@dataclass(frozen=True)
class SpeculationConfig:
    """What the settings say (`TSERVE_SPECULATION_MAX_DRAFT`, `TSERVE_SPECULATION_MAX_ROWS`)."""

    max_draft: int = MAX_DRAFT
    max_rows: int = MAX_ROWS

    @classmethod
    def from_settings(cls, settings) -> SpeculationConfig | None:
        """The configuration when `TSERVE_SPECULATION` turns it on, else None."""
        if settings.speculation == "off":
            return None
        return cls(settings.speculation_max_draft, settings.speculation_max_rows)


def speculable(backend, jobs: Sequence[TextJob], live_rows: int, config: SpeculationConfig | None) -> bool:
    """Whether a step of these jobs may speculate (before any draft is made)."""
    return (config is not None and 0 < live_rows <= config.max_rows and getattr(backend, "speculates", False)
            and all(job.search.single_row and getattr(job.search, "temperature", None) == 0.0 for job in jobs))


def draft_for(job: TextJob, drafter: NGramDrafter, config: SpeculationConfig, context_length: int) -> list[int]:
    """The job's draft for this step: the drafter brought up to date with its generated tokens (the last one is the
    pending token, fed now), and no more tokens than its search may still choose after the pending one nor than
    fit in the context."""
    search = job.search
    generated = search.generated
    drafter.extend(generated[len(drafter) - len(job.input_ids):].tolist())
    room = context_length - len(job.input_ids) - len(generated)  # positions after the pending token's
    return drafter.propose(min(config.max_draft, search.max_new_tokens - len(generated) - 1, room))


def step_verified(searches: Sequence, logits: np.ndarray, fed: Sequence[Sequence[int]]
                  ) -> tuple[list[StepResult | Exception], np.ndarray]:
    """Step each search on the logits of its fed positions (`logits` (searches, S, V): position i's follow
    ``fed[j][: i + 1]``) while its choice is the next fed token, all the searches still going at a position in one
    batched step -> (each search's last outcome, its `StepResult` or what it raised; how many of its fed tokens
    to keep: its pending token and the draft tokens its choices agreed with)."""
    outcomes: list[StepResult | Exception | None] = [None] * len(searches)
    kept = np.zeros(len(searches), np.int64)
    going = list(range(len(searches)))
    for i in range(logits.shape[1]):
        if not going:
            break
        results = step_searches([searches[j] for j in going], logits[going, i], isolate=True)
        still = []
        for j, result in zip(going, results):
            outcomes[j], kept[j] = result, i + 1
            if (not isinstance(result, Exception) and not result.done and i + 1 < len(fed[j])
                    and int(result.tokens[0]) == fed[j][i + 1]):
                still.append(j)
        going = still
    return outcomes, kept
