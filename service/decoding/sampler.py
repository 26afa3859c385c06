"""The batched sampler: one decoding step for many single-row searches (greedy and sampling) as array operations.

After vLLM's ``Sampler``: the logits of every single-row request of a step arrive as one (rows, V) array, and
the work is done over all rows at once: one float64 cast, one log-sum-exp, one argmax for the rows that need no
processing, the processors (`service.decoding.processors`) over the rows that do, grouped by parameter value,
and one cumulative-sum draw for the sampling rows. What stays per row is the per-request state: the seeded
random generator (one draw per sampling row, in the order each request would draw alone), n-gram bans, stop
strings and the bookkeeping of `GreedySearch._accept`. A request's tokens therefore do not depend on its batch:
every operation is row-wise, and a search stepped alone goes through this same code with one row.

The processing order per row is HF ``GenerationMixin._get_logits_processor``'s, with OpenAI's penalties where
vLLM applies them (see `SamplingSearch`): repetition penalty, presence/frequency penalties, n-gram ban,
``min_new_tokens`` EOS masking; then, for sampling rows only, temperature, top-k, top-p and the draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .base import StepResult
from .processors import (
    apply_openai_penalties,
    apply_repetition_penalty,
    top_k_filter,
    top_p_filter,
)

if TYPE_CHECKING:
    from .greedy import GreedySearch

__all__ = ["process_rows", "step_single_rows"]


def process_rows(searches: Sequence[GreedySearch], x: np.ndarray) -> np.ndarray:
    """Raw logits (rows, V) float64 of `searches` (one row each) -> processed logits (-inf = removed) for the
    next choice, given the tokens so far. Modifies and returns `x`."""
    processed_always = any(s.always_processed for s in searches)  # else greedy rows: only bans to apply
    if processed_always:
        _penalise(searches, x)
    for row, search in enumerate(searches):
        search.mask_banned(x[row])
    if processed_always:
        _warp(searches, x)
    return x


def _penalise(searches: Sequence[GreedySearch], x: np.ndarray) -> None:
    """In place: the repetition penalty, then OpenAI's presence/frequency penalties, on the rows that have them."""
    vocab = x.shape[1]
    penalty = np.array([s.repetition_penalty for s in searches])
    penalised = np.flatnonzero(penalty != 1.0)
    if penalised.size:
        seen = np.stack([searches[i].seen_tokens(vocab) for i in penalised])
        x[penalised] = apply_repetition_penalty(x[penalised], seen, penalty[penalised, None])
    presence = np.array([s.presence_penalty for s in searches])
    frequency = np.array([s.frequency_penalty for s in searches])
    counted = np.flatnonzero((presence != 0.0) | (frequency != 0.0))
    if counted.size:
        counts = np.stack([searches[i].token_counts(vocab) for i in counted])
        x[counted] = apply_openai_penalties(x[counted], counts, presence[counted, None], frequency[counted, None])


def _warp(searches: Sequence[GreedySearch], x: np.ndarray) -> None:
    """In place, on the sampling rows only: temperature, then top-k and top-p."""
    temperature = np.array([s.temperature for s in searches])
    sampled = np.flatnonzero(temperature > 0.0)
    if sampled.size == 0:
        return
    x[sampled] = x[sampled] / temperature[sampled, None]  # x / 1.0 is x exactly: no need to skip those rows
    for values, apply in (([s.top_k for s in searches], top_k_filter), ([s.top_p for s in searches], top_p_filter)):
        values = np.asarray(values)[sampled]
        for value in np.unique(values):  # one call per distinct value: the filters take a scalar
            if (value > 0) if apply is top_k_filter else (value < 1.0):
                rows = sampled[values == value]
                x[rows] = apply(x[rows], value)


def _draw(searches: Sequence[GreedySearch], x: np.ndarray) -> np.ndarray:
    """One token per row from the softmax of processed logits (rows, V): the inverse CDF at each request's next
    uniform draw. A row whose every token was removed takes its argmax and draws nothing (HF's multinomial would
    fail there)."""
    tokens = np.argmax(x, axis=1)
    top = x.max(axis=1)
    live = np.flatnonzero(top != -np.inf)
    if live.size == 0:
        return tokens
    p = np.subtract(x[live], top[live, None])
    np.exp(p, out=p)  # unnormalised probabilities; removed tokens are 0
    cum = np.cumsum(p, axis=1)
    target = np.array([searches[i].draw_uniform() for i in live]) * cum[:, -1]
    chosen = np.count_nonzero(cum <= target[:, None], axis=1)  # np.searchsorted(cum, target, side="right")
    for j in np.flatnonzero((chosen >= x.shape[1]) | (p[np.arange(live.size), np.minimum(chosen, x.shape[1] - 1)]
                                                      == 0.0)):
        chosen[j] = np.flatnonzero(p[j])[-1]  # float rounding at the very top of the CDF
    tokens[live] = chosen
    return tokens


def step_single_rows(searches: Sequence[GreedySearch], logits: np.ndarray, isolate: bool = False
                     ) -> list[StepResult | Exception]:
    """One step of single-row searches: `logits` (len(searches), V), row i for searches[i].

    ``isolate``: a search that raises gets its exception in its place in the result and the others go on (a
    failure in the shared array work is retried one row at a time, so that it concerns only the rows that
    cause it); otherwise the first exception propagates."""
    x = np.array(logits, dtype=np.float64)  # a copy: the processors work on their own
    if x.ndim != 2 or x.shape[0] != len(searches):
        raise ValueError(f"expected logits of shape ({len(searches)}, V), got {x.shape}")
    if any(s.done for s in searches):
        raise RuntimeError("step() called on a finished search")
    if not isolate:
        return _step(searches, x)
    try:
        tokens, peak, log_z = _choose(searches, x)
    except Exception:
        if len(searches) == 1:
            raise
        return [_isolated(_step_one, search, x[row]) for row, search in enumerate(searches)]
    return [_isolated(search.accept, *chosen) for search, chosen in zip(searches, _chosen(x, tokens, peak, log_z))]


def _isolated(function, *arguments) -> StepResult | Exception:
    """``function(*arguments)``, or the exception it raised."""
    try:
        return function(*arguments)
    except Exception as error:  # noqa: BLE001 - handed back to the caller, who fails that request only
        return error


def _step_one(search: GreedySearch, row: np.ndarray) -> StepResult:
    return _step([search], row[None, :].copy())[0]


def _step(searches: Sequence[GreedySearch], x: np.ndarray) -> list[StepResult]:
    tokens, peak, log_z = _choose(searches, x)
    return [search.accept(*chosen) for search, chosen in zip(searches, _chosen(x, tokens, peak, log_z))]


def _chosen(x: np.ndarray, tokens: np.ndarray, peak: np.ndarray, log_z: np.ndarray):
    """`accept`'s arguments for each row: token, its raw log-probability (computed for all rows at once, the
    same float64 operations as `log_softmax`), the raw row, its max and log-sum-exp."""
    logprobs = ((x[np.arange(len(tokens)), tokens] - peak) - log_z).tolist()
    return zip(tokens.tolist(), logprobs, x, peak.tolist(), log_z.tolist())


def _choose(searches: Sequence[GreedySearch], x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The next token of every row, with each row's max and log-sum-exp of the raw logits ``x`` (left as is)."""
    peak = x.max(axis=1)
    shifted = np.subtract(x, peak[:, None])
    np.exp(shifted, out=shifted)  # in place: a fresh temporary of this size costs more than the exp (page faults)
    log_z = np.log(shifted.sum(axis=1))
    processed = [i for i, s in enumerate(searches) if s.needs_processing()]
    if len(processed) < len(searches):
        tokens = np.argmax(x, axis=1)
    else:
        tokens = np.empty(len(searches), np.int64)
    if processed:
        group = [searches[i] for i in processed]
        p = process_rows(group, x[processed])
        sampled = [j for j, s in enumerate(group) if s.temperature > 0.0]
        chosen = np.argmax(p, axis=1)
        if sampled:
            chosen[sampled] = _draw([group[j] for j in sampled], p[sampled])
        tokens[processed] = chosen
    return tokens, peak, log_z
