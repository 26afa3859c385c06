"""Softmax, log-softmax and top-k over the last axis of score arrays: the one copy the searches, the sampler, the
OpenAI log-probabilities and image classification use.

Log-probabilities are computed in float64 as ``(x - max) - log(sum(exp(x - max)))`` (the max taken as 0 where a row
has no finite max, as ``torch.log_softmax`` avoids NaN there); `log_normaliser` gives the two terms of one row set
so that a caller can take the log-probability of a few tokens without materialising the whole (rows, V) array,
bit-identical to `log_softmax`; a large row set's normaliser is computed in row chunks on several threads
(numpy releases the GIL in its loops; every row's own operations are unchanged, so the result is the same bit for
bit: float64 `exp` is most of a beam search step's time outside ONNX Runtime, and is scalar code on a CPU without
AVX-512). Top-k orders by score, best first, ties by lower index first (a stable sort of
``-scores``): what OpenAI's ``top_logprobs`` and the classifiers' ranked labels return.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["block_maxima", "log_normaliser", "log_softmax", "softmax", "top_k_indices", "top_logprobs"]


def _finite_max(x: np.ndarray) -> np.ndarray:
    """The max over the last axis, kept as (..., 1); 0 where it is not finite (all -inf, or +inf)."""
    m = x.max(axis=-1, keepdims=True)
    return m if np.isfinite(m).all() else np.where(np.isfinite(m), m, 0.0)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax over the last axis, computed in float64. (..., V) -> (..., V)."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - _finite_max(x)
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


# A row set of at least this many entries per chunk is split across threads (`log_normaliser`): 2**17 float64
# exps take ~0.9 ms of scalar code (AVX2) or ~0.2 ms (AVX-512), against ~30 us to hand a chunk to a thread.
PARALLEL_CHUNK_ENTRIES = 2**17
MAX_NORMALISER_THREADS = 8  # beyond this many chunks memory bandwidth, not exp, is the limit

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _normaliser_threads() -> int:
    """The cores this process may run on, at most MAX_NORMALISER_THREADS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_NORMALISER_THREADS))


def _chunk_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_normaliser_threads() - 1, thread_name_prefix="log-normaliser")
        return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's threads did not come along (a pool of none would never run a chunk)."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def log_normaliser(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two terms of `log_softmax` for logits ``x`` (rows, V), float32 or float64, left as is: each row's max
    ``m`` and ``log_z``, the log-sum-exp of ``x - m``, both (rows,) float64;
    ``log_softmax(x)[r, j] == (float64(x[r, j]) - m[r]) - log_z[r]``, bit for bit (a float32 max is exact in
    float64, and the subtraction is done in float64). A large ``x`` is done in row chunks on several threads
    (`PARALLEL_CHUNK_ENTRIES`), with the same numbers."""
    rows = x.shape[0] if x.ndim == 2 else 1
    chunks = min(rows, x.size // PARALLEL_CHUNK_ENTRIES)
    if chunks >= 2:  # only then the cores are counted (a system call)
        chunks = min(chunks, _normaliser_threads())
    if chunks < 2:
        return _log_normaliser(x)
    bounds = np.linspace(0, rows, chunks + 1).astype(int).tolist()
    pool = _chunk_pool()
    others = [pool.submit(_log_normaliser, x[a:b]) for a, b in zip(bounds[1:-1], bounds[2:])]
    parts = [_log_normaliser(x[: bounds[1]])] + [future.result() for future in others]
    return np.concatenate([m for m, _ in parts]), np.concatenate([z for _, z in parts])


def _log_normaliser(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`log_normaliser` on the calling thread."""
    m = x.max(axis=-1, keepdims=True)
    finite = bool(np.isfinite(m).all())
    if not finite:
        m = np.where(np.isfinite(m), m, 0.0)
    e = np.subtract(x, m, dtype=np.float64)
    np.exp(e, out=e)  # in place: a fresh temporary of this size costs more than the exp (page faults)
    if finite:  # each row's sum holds its max's exp(0) = 1: no log(0) to silence (numpy's errstate costs a step ~1 us)
        log_z = np.log(e.sum(axis=-1))
    else:
        with np.errstate(divide="ignore"):
            log_z = np.log(e.sum(axis=-1))
    return m[..., 0].astype(np.float64, copy=False), log_z


def softmax(logits: np.ndarray) -> np.ndarray:
    """Softmax over the last axis, in the dtype of ``logits`` (float32 scores stay float32). (..., V) -> (..., V)."""
    x = np.asarray(logits)
    e = np.exp(x - _finite_max(x).astype(x.dtype, copy=False))
    return e / e.sum(axis=-1, keepdims=True)


def top_k_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """The indices of the ``k`` highest scores over the last axis, best first, ties by lower index first (what a
    stable sort of ``-scores`` gives); all of them when ``k`` exceeds the axis. (..., V) -> (..., min(k, V)).

    One row (V,) costs one partial selection and one comparison over V and a sort of ``k`` items only (a large
    vocabulary, a few alternatives); a batch of rows is sorted whole (a few classes per image)."""
    x = np.asarray(scores)
    v = x.shape[-1]
    k = max(0, min(int(k), v))
    if x.ndim != 1 or k == v:
        return np.argsort(-x, axis=-1, kind="stable")[..., :k]
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    idx = np.argpartition(-x, k - 1)[:k]  # the k largest, in no order, ties at the boundary arbitrary
    kth = x[idx].min()
    tied_in = x[idx] == kth
    tied_all = np.flatnonzero(x == kth)
    if tied_all.size > np.count_nonzero(tied_in):  # boundary tie: keep the lowest ids among the tied
        idx = np.concatenate([idx[~tied_in], tied_all[: np.count_nonzero(tied_in)]])
    return idx[np.lexsort((idx, -x[idx]))]  # by score descending, then index ascending


def top_logprobs(row: np.ndarray, n: int, m: float, log_z: float) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens of raw logits ``row`` (V,) float32 or float64 as (id, log-prob), best first, ties
    by lower id first. ``m`` and ``log_z`` are the row's `log_normaliser` terms: log-prob = ``(row - m) - log_z``
    in float64, bit-identical to `log_softmax`."""
    idx = top_k_indices(row, n)
    return list(zip(idx.tolist(), ((row[idx].astype(np.float64) - m) - log_z).tolist()))


def block_maxima(x: np.ndarray, block: int) -> np.ndarray:
    """The max of each run of ``block`` consecutive entries of the rows of ``x`` (rows, V), the last run shorter
    when ``block`` does not divide V: (rows, ceil(V / block)). The k best entries of a row lie in its k best
    blocks (ranked by their max, ties by lower block), so a top-k over a large vocabulary can look at a few blocks
    instead of every entry."""
    rows, v = x.shape
    full = v // block
    head = x[:, : full * block].reshape(rows, full, block).max(axis=-1)
    if full * block == v:
        return head
    return np.concatenate([head, x[:, full * block :].max(axis=-1, keepdims=True)], axis=1)
