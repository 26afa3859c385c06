"""Multinomial sampling with HF ``generate(do_sample=True)`` logits processing, plus the filters it uses.

Per step, on the raw logits of the single row, in the order of HF ``GenerationMixin._get_logits_processor``:
repetition penalty (prompt/prefix + generated tokens, ``RepetitionPenaltyLogitsProcessor``), then OpenAI's
``frequency_penalty`` / ``presence_penalty`` (not in HF; vLLM's ``apply_penalties`` order and formula:
``logits[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)``, ``count[j]`` = how often
``j`` was generated, prompt/prefix excluded), ``no_repeat_ngram_size`` (-inf for tokens that would repeat an
n-gram of prefix + generated tokens, ``NoRepeatNGramLogitsProcessor``, see `NGramBlocker`), ``min_new_tokens``
EOS masking, then the warpers temperature (``TemperatureLogitsWarper``), top-k (``TopKLogitsWarper``) and top-p
(``TopPLogitsWarper``), then a draw from the softmax with ``np.random.default_rng(seed)`` (same seed, same
output; HF's torch RNG is not reproduced). ``temperature == 0`` means greedy: argmax after the repetition
penalty, the OpenAI penalties, the n-gram ban and the EOS masking. The hypothesis score is the sum of the
model's log-probabilities of the chosen tokens (raw logits, before any processing), as in `GreedySearch`; so
are the recorded ``logprobs``.

The filter functions are public so they can be tested against HF's processors; they work on the last axis of
arrays of any leading shape and mark removed tokens with -inf.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .base import StopStrings, truncate_at_stop
from .greedy import GreedySearch

GREEDY_TEMPERATURE = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy decoding

__all__ = [
    "SamplingSearch",
    "apply_repetition_penalty",
    "apply_openai_penalties",
    "apply_temperature",
    "top_k_filter",
    "top_p_filter",
    "StopStrings",
    "truncate_at_stop",
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


class SamplingSearch(GreedySearch):
    """Sample one sequence (see the module docstring for the processing order).

    ``prefix``: tokens already in the sequence that the repetition penalty and the n-gram ban also cover (HF's
    processors see the whole ``input_ids``: the prompt for a decoder-only model, the decoder start token for an
    encoder-decoder one). ``no_repeat_ngram_size``: 0 = off, see `GreedySearch`.
    ``stop_checker``: see `GreedySearch` / `StopStrings`. ``logprobs``: see `GreedySearch` (always the raw
    distribution, before any of the processing here).
    ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] (OpenAI): subtract ``presence_penalty`` from the logit of
    every token generated at least once and ``frequency_penalty`` times its count; negative values encourage
    repetition. The prefix does not count.
    """

    def __init__(
        self,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        repetition_penalty: float = 1.0,
        min_new_tokens: int = 0,
        seed: int | None = None,
        prefix: Sequence[int] = (),
        stop_checker: Callable[[np.ndarray], bool] | None = None,
        no_repeat_ngram_size: int = 0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logprobs: int | None = None,
    ):
        super().__init__(max_new_tokens, eos_token_id, min_new_tokens=min_new_tokens, stop_checker=stop_checker,
                         no_repeat_ngram_size=no_repeat_ngram_size, prefix=prefix, logprobs=logprobs)
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        if top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 < top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if not -2.0 <= presence_penalty <= 2.0:
            raise ValueError("presence_penalty must be in [-2, 2]")
        if not -2.0 <= frequency_penalty <= 2.0:
            raise ValueError("frequency_penalty must be in [-2, 2]")
        # below GREEDY_TEMPERATURE, sampling is greedy (as vLLM): logits / 1e-300 overflow to inf and NaN
        self.temperature = 0.0 if temperature < GREEDY_TEMPERATURE else float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.repetition_penalty = float(repetition_penalty)
        self._rng = np.random.default_rng(seed)
        self.presence_penalty = float(presence_penalty)
        self.frequency_penalty = float(frequency_penalty)
        self._seen: np.ndarray | None = None  # (V,) bool: tokens in prefix + generated, built on the first step
        # (V,) int64: how often each token was generated (prefix excluded), built on the first step; None when the
        # OpenAI penalties are off
        self._counts: np.ndarray | None = None

    def process_logits(self, row: np.ndarray) -> np.ndarray:
        """Raw logits (V,) -> processed logits (V,) for the next draw (-inf = removed), given the tokens so far."""
        x = np.asarray(row, dtype=np.float64)
        if self.repetition_penalty != 1.0:
            if self._seen is None:
                v = x.shape[0]
                self._seen = np.zeros(v, dtype=bool)
                self._seen[self._prefix[(self._prefix >= 0) & (self._prefix < v)]] = True
            x = apply_repetition_penalty(x, self._seen, self.repetition_penalty)
        if self.presence_penalty != 0.0 or self.frequency_penalty != 0.0:
            if self._counts is None:
                self._counts = np.zeros(x.shape[0], dtype=np.int64)
            x = apply_openai_penalties(x, self._counts, self.presence_penalty, self.frequency_penalty)
        x = self._block_ngrams(x)
        x = self._mask_eos(x)
        if self.temperature == 0.0:
            return x
        if self.temperature != 1.0:
            x = apply_temperature(x, self.temperature)
        if self.top_k > 0:
            x = top_k_filter(x, self.top_k)
        if self.top_p < 1.0:
            x = top_p_filter(x, self.top_p)
        return x

    def _choose(self, row: np.ndarray) -> int:
        x = self.process_logits(row)  # (V,)
        # temperature 0 = greedy; if the processors removed every token (n-gram ban of a tiny vocabulary), where HF's
        # multinomial would fail, take the argmax like greedy decoding does
        top = None if self.temperature == 0.0 else x.max()
        if top is None or top == -np.inf:
            tok = int(np.argmax(x))
        else:
            p = np.exp(x - top)  # (V,) unnormalised probabilities; removed tokens are 0
            cum = np.cumsum(p)
            tok = int(np.searchsorted(cum, self._rng.random() * cum[-1], side="right"))
            if tok >= x.shape[0] or p[tok] == 0.0:  # float rounding at the very top of the CDF
                tok = int(np.flatnonzero(p)[-1])
        if self._seen is not None:
            self._seen[tok] = True
        if self._counts is not None:  # an EOS is counted too, but it ends the sequence
            self._counts[tok] += 1
        return tok
