"""One decoding step for all the searches of a batch at once (`step_searches`), and the offline driver built on it.

A step's logits arrive as one (rows, V) array with each search's rows together, in order. Single-row searches
(greedy, sampling) go through the batched sampler as one group (`service.decoding.sampling.step_single_rows`),
whatever their parameters; beam searches share one log-softmax normaliser over all their rows (`log_normaliser`),
then each masks its own rows and selects its continuations (its finished set and stopping rule are its own). The
batching scheduler and `run_search` both step through here, so offline decoding and serving make the same choices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

import numpy as np

from .beam import BeamSearch
from .beam_candidates import CANDIDATE_BLOCK, top_candidates
from .distributions import block_maxima, log_normaliser
from .sampling import step_single_rows
from .types import Search, StepLogits, StepResult, isolated

__all__ = ["run_search", "step_searches"]


def step_searches(searches: Sequence[Search], logits: np.ndarray | StepLogits, isolate: bool = False
                  ) -> list[StepResult | Exception]:
    """Step every search: ``logits`` (sum of ``num_rows``, V), the rows of ``searches[i]`` after those of the
    searches before it, or a `StepLogits` of those rows (each row's most likely tokens beside its logits: the beam
    searches that need no more of them than it holds choose among those, `_step_beam_candidates`). Returns one
    `StepResult` per search, in order.

    ``isolate``: a search that raises gets its exception in its place and the others go on (the scheduler fails
    that request only); otherwise the first exception propagates."""
    step = logits if isinstance(logits, StepLogits) else None
    logits = logits.logits if step is not None else logits
    if all(s.single_row for s in searches):  # greedy and sampling only: the batched sampler alone
        if logits.shape[0] != len(searches):
            raise ValueError(f"expected logits for {len(searches)} rows, got {logits.shape[0]}")
        return step_single_rows(searches, logits, isolate)
    sizes = [s.num_rows for s in searches]
    if logits.shape[0] != sum(sizes):
        raise ValueError(f"expected logits for {sum(sizes)} rows, got {logits.shape[0]}")
    starts = list(accumulate(sizes[:-1], initial=0))
    results: list[StepResult | None] = [None] * len(searches)
    single = [i for i, s in enumerate(searches) if s.single_row]
    if single:
        rows = logits if len(single) == len(searches) else logits[[starts[i] for i in single]]
        for i, result in zip(single, step_single_rows([searches[i] for i in single], rows, isolate)):
            results[i] = result
    chosen = [] if step is None else [i for i, s in enumerate(searches) if isinstance(s, BeamSearch)
                                      and 0 < s.row_candidates <= step.k]
    _step_beam_candidates(chosen, searches, step, starts, results, isolate)
    taken = set(chosen)
    several = [i for i, s in enumerate(searches) if results[i] is None and i not in taken]
    if several:
        rows = np.concatenate([np.arange(starts[i], starts[i] + sizes[i]) for i in several])
        x = logits[rows]  # a copy, which the searches mask in place
        peak, log_z = log_normaliser(x)
        first = dict(zip(several, accumulate([sizes[i] for i in several[:-1]], initial=0)))
        beams = {i for i in several if isinstance(searches[i], BeamSearch)}
        for i in several:
            view = slice(first[i], first[i] + sizes[i])
            if i in beams:  # part b now, parts c-g below with the candidates of every beam search of the step
                _into(results, i, isolate, searches[i].mask, x[view])
            else:
                _into(results, i, isolate, searches[i].step_rows, x[view], peak[view], log_z[view])
        masked = [i for i in several if i in beams and results[i] is None]
        _step_beams(masked, searches, x, peak, log_z, first, results, isolate)
    return results


def _step_beam_candidates(beams: list[int], searches: Sequence[Search], step: StepLogits | None,
                          starts: list[int], results: list, isolate: bool) -> None:
    """The beam searches ``beams`` on their rows' most likely tokens (`StepLogits`): each search masks what its
    processors ban among them (`BeamSearch.mask_candidates`), then the searches with as many rows and candidates
    take their best K of rows x k together, ties by lower ``row * V + token`` (the order of a top-K over every
    entry: a row's tokens beyond its k best rank after them), and each does its own bookkeeping (`advance`)."""
    if not beams:
        return
    vocab, k = step.logits.shape[1], step.k
    groups: dict[tuple[int, int], list[int]] = {}
    for i in beams:
        groups.setdefault((searches[i].num_rows, searches[i].candidates), []).append(i)
    for (R, K), members in groups.items():
        rows = np.array([starts[i] for i in members], dtype=np.int64)[:, None] + np.arange(R)  # (S, R)
        logprobs = step.top_logprobs[rows].astype(np.float64)  # (S, R, k)
        ids = step.top_ids[rows]
        for s, i in enumerate(members):
            if searches[i].masks:
                _into(results, i, isolate, searches[i].mask_candidates, logprobs[s], ids[s])
        scores = (np.stack([searches[i].beam_scores for i in members])[..., None] + logprobs).reshape(-1, R * k)
        flat = (np.arange(R)[:, None] * vocab + ids).reshape(-1, R * k)
        top = np.lexsort((flat, -scores), axis=-1)[:, :K]  # R x k entries a search: a sort is cheapest
        search = np.arange(len(members))[:, None]
        tops, top_scores = flat[search, top], scores[search, top]
        for s, i in enumerate(members):
            if results[i] is None:  # its masking did not raise
                _into(results, i, isolate, searches[i].advance, tops[s], top_scores[s], vocab)


def _into(results: list, i: int, isolate: bool, function: Callable, *arguments) -> None:
    """``results[i] = function(*arguments)``; what it raises goes in ``results[i]`` with ``isolate``, else up."""
    results[i] = isolated(function, *arguments)
    if isinstance(results[i], Exception) and not isolate:
        raise results[i]


def _step_beams(beams: list[int], searches: Sequence[Search], x: np.ndarray, peak: np.ndarray, log_z: np.ndarray,
                first: dict[int, int], results: list, isolate: bool) -> None:
    """Parts c-g of the beam searches ``beams`` (masked already): the top-K candidates of all the searches with
    as many rows and candidates at once (`top_candidates`), then each search's own bookkeeping (`advance`)."""
    if not beams:
        return
    maxima = block_maxima(x, CANDIDATE_BLOCK)
    groups: dict[tuple[int, int], list[int]] = {}
    for i in beams:
        groups.setdefault((searches[i].num_rows, searches[i].candidates), []).append(i)
    for (_, k), members in groups.items():
        scores = np.stack([searches[i].beam_scores for i in members])
        starts = np.array([first[i] for i in members], dtype=np.int64)
        tops, top_scores = top_candidates(x, peak, log_z, maxima, scores, starts, k)
        for i, top, top_score in zip(members, tops, top_scores):
            _into(results, i, isolate, searches[i].advance, top, top_score, x.shape[1])


StepFn = Callable[[np.ndarray, np.ndarray], "np.ndarray | StepLogits"]


def run_search(searches: Sequence[Search], first_logits: Sequence[np.ndarray] | StepLogits, step_fn: StepFn) -> None:
    """Drive ``searches`` to completion offline (a reference driver; the server uses a batching scheduler).

    ``first_logits[i]``: logits (V,) or (1, V) of the prefill row of ``searches[i]`` (decoder-only: at the last
    prompt position; encoder-decoder: after feeding the decoder start token), or a `StepLogits` of the prefill
    rows. The prefill rows form the initial row set: row ``i`` belongs to ``searches[i]``.

    ``step_fn(tokens, parents) -> logits``: ``tokens`` and ``parents`` are int64 arrays of shape (R,). The model
    builds its new row ``r`` from its previous row ``parents[r]`` (a global index into the rows of the previous
    call, or into the prefill rows on the first call) extended by ``tokens[r]``, and returns the next-token
    logits of the new rows, shape (R, V), or a `StepLogits` of them. Rows are grouped per still-active search, in
    the order of ``searches``, each group in the order of that search's `StepResult`. ``step_fn`` is not called
    once every search is done (a search may finish on its prefill logits).
    """
    first_rows = first_logits.logits if isinstance(first_logits, StepLogits) else first_logits
    if len(searches) != len(first_rows):
        raise ValueError("need one first_logits entry per search")
    if not isinstance(first_logits, StepLogits):
        first_logits = np.stack([np.asarray(fl).reshape(-1) for fl in first_logits])
    steps = step_searches(searches, first_logits)
    if all(s.single_row for s in searches):
        return _run_single_rows(searches, steps, step_fn)
    offsets = np.arange(len(searches), dtype=np.int64)  # first row of each search in the previous row set
    while True:
        tokens, parents, active, new_offsets = [], [], [], []
        n_rows = 0
        for search, res, off in zip(searches, steps, offsets):
            if res.done or len(res.tokens) == 0:
                continue
            tokens.append(res.tokens)
            parents.append(res.parents + off)
            active.append(search)
            new_offsets.append(n_rows)
            n_rows += len(res.tokens)
        if not active:
            return
        logits = step_fn(np.concatenate(tokens), np.concatenate(parents))  # (n_rows, V)
        if not isinstance(logits, StepLogits):
            logits = np.asarray(logits)
        returned = (logits.logits if isinstance(logits, StepLogits) else logits).shape[0]
        if returned != n_rows:
            raise ValueError(f"step_fn returned {returned} rows, expected {n_rows}")
        steps = step_searches(active, logits)
        searches = active
        offsets = np.asarray(new_offsets, dtype=np.int64)


def _run_single_rows(searches: Sequence[Search], steps: list[StepResult], step_fn: StepFn) -> None:
    """`run_search`'s loop when every search is single-row (greedy, sampling): one row per search still running,
    which continues that search's row of the previous call, so the rows are the running searches in order and a
    step's parents are where they were (the same calls as the general loop, without its per-search arrays)."""
    while True:
        running = [i for i, res in enumerate(steps) if not res.done]
        if not running:
            return
        tokens = np.array([steps[i].tokens[0] for i in running], dtype=np.int64)
        logits = step_fn(tokens, np.array(running, dtype=np.int64))
        if not isinstance(logits, StepLogits):
            logits = np.asarray(logits)
        returned = (logits.logits if isinstance(logits, StepLogits) else logits).shape[0]
        if returned != len(running):
            raise ValueError(f"step_fn returned {returned} rows, expected {len(running)}")
        searches = [searches[i] for i in running]
        steps = step_searches(searches, logits)
