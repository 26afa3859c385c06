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

The processors live in `service.decoding.processors` (re-exported here); `service.decoding.sampler` applies them
and draws for many requests at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .base import StopStrings, truncate_at_stop
from .greedy import GreedySearch
from .processors import (
    GREEDY_TEMPERATURE,
    apply_openai_penalties,
    apply_repetition_penalty,
    apply_temperature,
    top_k_filter,
    top_p_filter,
)
from .sampler import process_rows

__all__ = [
    "SamplingSearch",
    "StopStrings",
    "apply_openai_penalties",
    "apply_repetition_penalty",
    "apply_temperature",
    "top_k_filter",
    "top_p_filter",
    "truncate_at_stop",
]


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
        self.always_processed = bool(self.temperature > 0.0 or self.repetition_penalty != 1.0
                                     or self.presence_penalty or self.frequency_penalty)

    def seen_tokens(self, vocab: int) -> np.ndarray:
        """(V,) bool: the tokens of prefix + generated so far (the repetition penalty's set), built on first use."""
        if self._seen is None:
            self._seen = np.zeros(vocab, dtype=bool)
            self._seen[self._prefix[(self._prefix >= 0) & (self._prefix < vocab)]] = True
        return self._seen

    def token_counts(self, vocab: int) -> np.ndarray:
        """(V,) int64: how often each token was generated (prefix excluded), built on first use."""
        if self._counts is None:
            self._counts = np.zeros(vocab, dtype=np.int64)
        return self._counts

    def draw_uniform(self) -> float:
        """This request's next uniform draw in [0, 1)."""
        return self._rng.random()

    def _note_choice(self, tok: int) -> None:
        if self._seen is not None:
            self._seen[tok] = True
        if self._counts is not None:  # an EOS is counted too, but it ends the sequence
            self._counts[tok] += 1

    def process_logits(self, row: np.ndarray) -> np.ndarray:
        """Raw logits (V,) -> processed logits (V,) for the next draw (-inf = removed), given the tokens so far."""
        return process_rows([self], np.array(row, dtype=np.float64)[None, :])[0]
