"""The top-K continuations of many beam searches in one set of array operations (a step of `BeamSearch`, part c).

A beam search's candidates are every (beam row, token) pair scored ``score[row] + log_softmax(logits)[row, token]``;
it keeps the best K, ties by lower flat index ``row * V + token``. Over a vocabulary of 8,000 that is a top-k
over R x 8,000 entries per search and step. Instead, each row is cut into blocks of `CANDIDATE_BLOCK` tokens:
the K best entries lie in the K best blocks (ranked by their best entry, ties by lower block), so a search looks
at its rows' block maxima, then at K blocks' entries only. The searches of a step that have as many rows and
keep as many candidates go through together, as (searches, ...) arrays: a step costs a fixed number of numpy
calls, not a number per request. The results are bit-identical to a top-k over the whole candidate array (the
same float64 operations as `log_softmax` for each entry that is looked at; `tests/unit/decoding/
test_beam_candidates.py`).
"""

from __future__ import annotations

import numpy as np

from .distributions import block_maxima

__all__ = ["CANDIDATE_BLOCK", "search_candidates", "top_candidates", "top_k_rows"]

# Vocabulary entries per block: with V = 8,000 a beam row has 125 blocks, and a search looks at R x 125 block
# maxima and K x 64 entries instead of R x 8,000.
CANDIDATE_BLOCK = 64


def top_k_rows(values: np.ndarray, k: int, keys: np.ndarray | None = None) -> np.ndarray:
    """Per row of ``values`` (S, N): the columns of its ``k`` highest values, best first, ties by lower ``keys``
    (S, N) (default: the column), what `top_k_indices` gives for one row. -> (S, min(k, N)).

    A partial selection per row, then a sort of ``k`` items; a row whose k-th value is tied with values left out
    takes its tied entries in key order (a full sort of that row: rare)."""
    S, N = values.shape
    k = max(0, min(int(k), N))
    if keys is None:
        keys = np.broadcast_to(np.arange(N), values.shape)
    if k in (0, N):
        return np.lexsort((keys, -values), axis=-1)[:, :k]
    part = np.argpartition(-values, k - 1, axis=-1)[:, :k]
    chosen = np.take_along_axis(values, part, axis=-1)
    kth = chosen.min(axis=-1, keepdims=True)
    tied_out = np.count_nonzero(values == kth, axis=-1) > np.count_nonzero(chosen == kth, axis=-1)
    for s in np.flatnonzero(tied_out):
        part[s] = np.lexsort((keys[s], -values[s]))[:k]
    order = np.lexsort((np.take_along_axis(keys, part, axis=-1), -np.take_along_axis(values, part, axis=-1)),
                       axis=-1)
    return np.take_along_axis(part, order, axis=-1)


def top_candidates(x: np.ndarray, peak: np.ndarray, log_z: np.ndarray, maxima: np.ndarray, scores: np.ndarray,
                   starts: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` continuations of S searches that each have R rows, ``scores`` (S, R) their accumulated
    log-probs, search s's rows being ``x[starts[s] : starts[s] + R]``.

    ``x`` (rows, V): raw logits, masked (-inf) by each search's processors; ``peak``, ``log_z`` (rows,): their
    `log_normaliser` terms, taken before masking; ``maxima``: ``block_maxima(x, CANDIDATE_BLOCK)``. Returns the
    flat indices ``row * V + token`` within each search (S, min(k, R * V)), best first, ties by lower flat index,
    and their scores ``scores[s, row] + ((x - peak) - log_z)`` in float64."""
    block = CANDIDATE_BLOCK
    S, R = scores.shape
    vocab, n_blocks = x.shape[1], maxima.shape[1]
    k = min(int(k), R * vocab)
    rows = starts[:, None] + np.arange(R)  # (S, R) rows of x
    row_peak, row_log_z = peak[rows][..., None], log_z[rows][..., None]  # (S, R, 1)
    block_scores = scores[..., None] + ((maxima[rows].astype(np.float64) - row_peak)
                                        - row_log_z)  # (S, R, blocks): each block's best candidate
    chosen = np.sort(top_k_rows(block_scores.reshape(S, R * n_blocks), k), axis=-1)  # (S, kb) ascending
    block_row, first = np.divmod(chosen, n_blocks)
    cols = (first * block)[..., None] + np.arange(block)  # (S, kb, block) ascending flat order
    inside = cols < vocab  # the last block of a row is shorter when the block does not divide V
    x_rows = np.take_along_axis(rows, block_row, axis=-1)[..., None]  # (S, kb, 1)
    logits = x[x_rows, np.minimum(cols, vocab - 1)].astype(np.float64)
    search = np.arange(S)[:, None, None]
    cand = scores[search, block_row[..., None]] + ((logits - peak[x_rows]) - log_z[x_rows])
    flat = block_row[..., None] * vocab + cols
    cand = np.where(inside, cand, -np.inf).reshape(S, -1)
    keys = np.where(inside, flat, R * vocab).reshape(S, -1)  # past-the-end entries rank after every real one
    top = top_k_rows(cand, k, keys)
    return np.take_along_axis(flat.reshape(S, -1), top, axis=-1), np.take_along_axis(cand, top, axis=-1)


def search_candidates(x: np.ndarray, peak: np.ndarray, log_z: np.ndarray, scores: np.ndarray, k: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """`top_candidates` for one search whose rows are all of ``x`` -> (min(k, R * V),) flat indices, scores."""
    maxima = block_maxima(x, CANDIDATE_BLOCK)
    top, top_scores = top_candidates(x, peak, log_z, maxima, scores[None, :], np.zeros(1, np.int64), k)
    return top[0], top_scores[0]
