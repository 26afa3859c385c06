"""The batched sampler: the next token of many single-row requests (greedy and sampling) as array operations.

After vLLM's ``Sampler`` and TGI's ``Greedy`` / ``Sampling``: the logits of the rows to process arrive as one
(rows, V) array with each row's parameters and state as arrays beside it (`RowParams`: temperatures, penalties,
seen-token sets, token counts, ban masks, each row's own random generator), and the sampler never calls back into
the requests. Greedy decoding is temperature 0: the argmax of the processed logits; a row with a temperature draws
from their softmax. The work is done over all rows at once: the processors (`service.decoding.processors`) grouped
by parameter value, one cumulative-sum draw for the sampling rows. Every operation is row-wise, so a request's
token does not depend on its batch.

The processing order per row is HF ``GenerationMixin._get_logits_processor``'s, with OpenAI's penalties where
vLLM applies them: repetition penalty, presence/frequency penalties, the ban mask (n-gram ban, ``min_new_tokens``
EOS masking); then, for sampling rows only, temperature, top-k, top-p and the draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .processors import apply_openai_penalties, apply_repetition_penalty, top_k_filter, top_p_filter

__all__ = ["RowParams", "choose", "process"]


@dataclass
class RowParams:
    """The parameters and state of the rows the sampler processes, row ``i`` for row ``i`` of the logits (R rows).

    ``seen[i]`` is read only where ``repetition_penalty[i] != 1`` and ``counts[i]`` only where a penalty of
    OpenAI's is on (None elsewhere); ``generators[i]`` only where ``temperature[i] > 0``, one uniform draw per step
    (none for a row whose every token was removed), so a seeded request draws the same numbers in any batch."""

    temperature: np.ndarray  # (R,) float64; 0 = greedy
    top_k: np.ndarray  # (R,) int64; 0 = off
    top_p: np.ndarray  # (R,) float64; 1 = off
    repetition_penalty: np.ndarray  # (R,) float64; 1 = off
    presence_penalty: np.ndarray  # (R,) float64; 0 = off
    frequency_penalty: np.ndarray  # (R,) float64; 0 = off
    seen: Sequence[np.ndarray | None]  # (V,) bool per row: the tokens of prefix + generated so far
    counts: Sequence[np.ndarray | None]  # (V,) int64 per row: how often each token was generated
    banned: np.ndarray  # (R, V) bool: tokens the row must not take
    generators: Sequence[np.random.Generator | None]  # each sampling row's own random generator


def process(x: np.ndarray, rows: RowParams) -> np.ndarray:
    """Raw logits (R, V) float64 -> processed logits (-inf = removed) for the next choice. Modifies and returns
    ``x``."""
    _penalise(x, rows)
    np.copyto(x, -np.inf, where=rows.banned)
    _warp(x, rows)
    return x


def choose(x: np.ndarray, rows: RowParams) -> np.ndarray:
    """The next token of every row (R,) int64 from its raw logits ``x`` (R, V) float64, which this modifies."""
    p = process(x, rows)
    tokens = np.argmax(p, axis=1)
    sampled = np.flatnonzero(rows.temperature > 0.0)
    if sampled.size:
        tokens[sampled] = _draw(p[sampled], [rows.generators[i] for i in sampled])
    return tokens


def _penalise(x: np.ndarray, rows: RowParams) -> None:
    """In place: the repetition penalty, then OpenAI's presence/frequency penalties, on the rows that have them."""
    penalty = rows.repetition_penalty
    penalised = np.flatnonzero(penalty != 1.0)
    if penalised.size:
        seen = np.stack([rows.seen[i] for i in penalised])
        x[penalised] = apply_repetition_penalty(x[penalised], seen, penalty[penalised, None])
    presence, frequency = rows.presence_penalty, rows.frequency_penalty
    counted = np.flatnonzero((presence != 0.0) | (frequency != 0.0))
    if counted.size:
        counts = np.stack([rows.counts[i] for i in counted])
        x[counted] = apply_openai_penalties(x[counted], counts, presence[counted, None], frequency[counted, None])


def _warp(x: np.ndarray, rows: RowParams) -> None:
    """In place, on the sampling rows only: temperature, then top-k and top-p."""
    sampled = np.flatnonzero(rows.temperature > 0.0)
    if sampled.size == 0:
        return
    x[sampled] = x[sampled] / rows.temperature[sampled, None]  # x / 1.0 is x exactly: no need to skip those rows
    for values, apply, on in ((rows.top_k, top_k_filter, lambda k: k > 0), (rows.top_p, top_p_filter,
                                                                              lambda p: p < 1.0)):
        values = values[sampled]
        for value in np.unique(values):  # one call per distinct value: the filters take a scalar
            if on(value):
                group = sampled[values == value]
                x[group] = apply(x[group], value)


def _draw(x: np.ndarray, generators: Sequence[np.random.Generator]) -> np.ndarray:
    """One token per row from the softmax of processed logits (rows, V): the inverse CDF at each row's next
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
    target = np.array([generators[i].random() for i in live]) * cum[:, -1]
    chosen = np.count_nonzero(cum <= target[:, None], axis=1)  # np.searchsorted(cum, target, side="right")
    for j in np.flatnonzero((chosen >= x.shape[1]) | (p[np.arange(live.size), np.minimum(chosen, x.shape[1] - 1)]
                                                      == 0.0)):
        chosen[j] = np.flatnonzero(p[j])[-1]  # float rounding at the very top of the CDF
    tokens[live] = chosen
    return tokens
