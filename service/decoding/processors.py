"""Logits processors of HF ``generate()`` (and OpenAI's penalties), as array functions.

They work on the last axis of arrays of any leading shape and mark removed tokens with -inf; parameters may be
scalars or arrays that broadcast against the logits (one value per row, shape (rows, 1)). They are public so they
can be tested against HF's processors, and `service.decoding.sampler` applies them to many rows at once.
"""

from __future__ import annotations

import numpy as np

GREEDY_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy decoding

__all__ = [
    "GREEDY_TEMPERATURE",
    "apply_openai_penalties",
    "apply_repetition_penalty",
    "apply_temperature",
    "top_k_filter",
    "top_p_filter",
]


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """HF repetition penalty: for tokens where ``seen`` (..., V) is true, divide positive logits by ``penalty``
    and multiply negative ones by it."""
    x = np.asarray(logits)
    return np.where(seen, np.where(x < 0, x * penalty, x / penalty), x)


def apply_openai_penalties(logits: np.ndarray, counts: np.ndarray, presence_penalty: float,
                           frequency_penalty: float) -> np.ndarray:
    """OpenAI/vLLM penalties: ``logits - frequency_penalty * counts - presence_penalty * (counts > 0)``, where
    ``counts`` (..., V) says how often each token was generated so far (prompt excluded)."""
    x = np.asarray(logits)
    return x - (frequency_penalty * counts + presence_penalty * (counts > 0))


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """HF temperature warper: logits / temperature (temperature > 0)."""
    return np.asarray(logits) / temperature


def top_k_filter(logits: np.ndarray, top_k: int, min_tokens_to_keep: int = 1) -> np.ndarray:
    """HF top-k: keep every token whose logit is >= the k-th largest (ties at the k-th value are all kept)."""
    x = np.asarray(logits)
    v = x.shape[-1]
    k = min(max(int(top_k), min_tokens_to_keep), v)
    kth = np.partition(x, v - k, axis=-1)[..., v - k : v - k + 1]  # (..., 1): k-th largest
    return np.where(x < kth, -np.inf, x)


def top_p_filter(logits: np.ndarray, top_p: float, min_tokens_to_keep: int = 1) -> np.ndarray:
    """HF top-p (nucleus): sort ascending, drop tokens while the cumulative probability is <= 1 - top_p, so the
    smallest set whose probability reaches ``top_p`` survives; at least ``min_tokens_to_keep`` are kept."""
    x = np.asarray(logits)
    order = np.argsort(x, axis=-1, kind="stable")  # ascending, (..., V)
    sorted_x = np.take_along_axis(x, order, axis=-1).astype(np.float64)
    m = sorted_x[..., -1:]
    p = np.exp(sorted_x - np.where(np.isfinite(m), m, 0.0))
    cum = np.cumsum(p, axis=-1) / np.sum(p, axis=-1, keepdims=True)
    remove_sorted = cum <= (1.0 - top_p)
    remove_sorted[..., -min_tokens_to_keep:] = False
    remove = np.empty_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, axis=-1)
    return np.where(remove, -np.inf, x)
