"""Greedy decoding: one row, argmax at every step (HF ``generate(do_sample=False, num_beams=1)``).

The raw logits go through HF's processors for greedy decoding, in ``_get_logits_processor`` order:
``no_repeat_ngram_size`` (``NoRepeatNGramLogitsProcessor``: -inf for every token that would repeat an n-gram of
prefix + generated tokens, see `NGramBlocker`), then ``min_new_tokens`` (EOS -> -inf for the first steps, like
``MinNewTokensLengthLogitsProcessor``); the token is the argmax of the result. The score of a hypothesis is the sum
of the model's log-probabilities (log-softmax of the raw logits, before any processing) of the chosen tokens, EOS
included when the sequence ends with it. With ``logprobs=N`` the search also records, per generated token (EOS
excluded), that raw log-probability and the N most likely tokens of the same raw distribution (OpenAI
``logprobs`` / ``top_logprobs``, see `TokenLogprob`). `GreedySearch` is also the single-row base of
`SamplingSearch`, which sets the processing parameters; both step through the batched sampler
(`service.decoding.sampler`), alone or many requests at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .base import (
    Hypothesis,
    NGramBlocker,
    Search,
    StepResult,
    TokenLogprob,
    eos_ids,
    finished_step,
    top_logprobs,
)
from .sampler import step_single_rows

__all__ = ["GreedySearch"]

_ZERO = np.zeros(1, dtype=np.int64)  # every single-row step continues row 0: one shared, read-only array
_ZERO.flags.writeable = False


class GreedySearch(Search):
    """Argmax decoding of one sequence.

    ``stop_checker(generated_tokens) -> bool`` (e.g. `StopStrings`) is called with the int64 array of generated
    tokens after every non-EOS token; True ends the sequence with finish_reason "stop".
    ``no_repeat_ngram_size`` (0 = off) bans repeated n-grams over ``prefix`` + generated tokens; ``prefix`` is
    what HF's processors see in ``input_ids`` before the first new token: the prompt for a decoder-only model,
    the decoder start token for an encoder-decoder one.
    ``logprobs``: None records nothing (no cost); N >= 0 records one `TokenLogprob` per generated token (the
    chosen token's raw log-prob and the top N of the raw distribution), see `token_logprobs`.
    """

    def __init__(
        self,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None,
        min_new_tokens: int = 0,
        stop_checker: Callable[[np.ndarray], bool] | None = None,
        no_repeat_ngram_size: int = 0,
        prefix: Sequence[int] = (),
        logprobs: int | None = None,
    ):
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if no_repeat_ngram_size < 0:
            raise ValueError("no_repeat_ngram_size must be >= 0")
        if logprobs is not None and logprobs < 0:
            raise ValueError("logprobs must be None or >= 0")
        self.max_new_tokens = int(max_new_tokens)
        self.eos = eos_ids(eos_token_id)  # (n_eos,)
        self._eos_set = frozenset(self.eos.tolist())  # `in` on a set, not on an array, every step
        self.always_processed = False  # every choice processed (sampling, penalties): `SamplingSearch` sets it
        self.min_new_tokens = int(min_new_tokens)
        self.stop_checker = stop_checker
        self.no_repeat_ngram_size = int(no_repeat_ngram_size)
        self._prefix = np.asarray(list(prefix), dtype=np.int64)  # (P,)
        # incremental n-gram ban over prefix + generated tokens; None when off
        self._ngrams = NGramBlocker(self.no_repeat_ngram_size, self._prefix) if self.no_repeat_ngram_size else None
        self._tokens = np.zeros(self.max_new_tokens, dtype=np.int64)  # generated tokens, EOS excluded
        self._n = 0  # tokens generated so far, EOS included
        self._score = 0.0
        self._reason: str | None = None
        self.logprobs = None if logprobs is None else int(logprobs)
        # one entry per generated token (EOS excluded), aligned with `generated`; None when not recording
        self._logprobs: list[TokenLogprob] | None = None if logprobs is None else []

    @property
    def num_rows(self) -> int:
        return 0 if self._reason is not None else 1

    @property
    def done(self) -> bool:
        return self._reason is not None

    @property
    def generated(self) -> np.ndarray:
        """Tokens generated so far, EOS excluded (a view, shape (n,))."""
        return self._tokens[: self._n - (self._reason == "eos")]

    @property
    def token_logprobs(self) -> list[TokenLogprob]:
        """Recorded log-probs, ``token_logprobs[i]`` for ``generated[i]`` (same length at every step; empty when
        ``logprobs`` is None). The live list, not a copy: read it, do not mutate it."""
        return self._logprobs if self._logprobs is not None else []

    # Processing parameters: none for greedy decoding; `SamplingSearch` sets them (see `sampler.process_rows`).
    temperature = 0.0
    top_k = 0
    top_p = 1.0
    repetition_penalty = 1.0
    presence_penalty = 0.0
    frequency_penalty = 0.0
    single_row = True  # steps through `sampler.step_single_rows`, many requests at once

    def needs_processing(self) -> bool:
        """Whether the next choice is more than the argmax of the raw logits."""
        return (self.always_processed or (self._n < self.min_new_tokens and bool(self._eos_set))
                or (self._ngrams is not None and bool(self._ngrams.banned())))

    def mask_banned(self, row: np.ndarray) -> None:
        """In place on logits (V,): -inf for tokens that would repeat an n-gram (``no_repeat_ngram_size``), then
        for EOS while fewer than ``min_new_tokens`` tokens were generated."""
        if self._ngrams is not None and self._ngrams.banned():
            row[self._ngrams.banned_ids(row.shape[-1])] = -np.inf
        if self._n < self.min_new_tokens and self.eos.size:
            row[self.eos] = -np.inf

    def step(self, logits: np.ndarray) -> StepResult:
        logits = np.asarray(logits)
        if logits.ndim != 2 or logits.shape[0] != 1:
            raise ValueError(f"expected logits of shape (1, V), got {logits.shape}")
        return step_single_rows([self], logits)[0]

    def accept(self, tok: int, lp: float, row: np.ndarray, m: float, log_z: float) -> StepResult:
        """Record the chosen token ``tok`` and its raw log-probability ``lp`` (``(row[tok] - m) - log_z``, as
        `log_softmax` computes it) given the raw logits ``row`` (V,) float64, their max ``m`` and log-sum-exp
        ``log_z`` (of ``row - m``; read only for ``logprobs``); decides whether the sequence ends."""
        self._note_choice(tok)
        self._score += lp
        self._n += 1
        if tok in self._eos_set:
            self._reason = "eos"
        else:
            self._tokens[self._n - 1] = tok
            if self._logprobs is not None:  # before the stop check: aligned with `generated` at every step
                top = top_logprobs(row, self.logprobs, m, log_z) if self.logprobs else []
                self._logprobs.append(TokenLogprob(tok, lp, top))
            if self._ngrams is not None:
                self._ngrams.append(tok)
            if self.stop_checker is not None and self.stop_checker(self._tokens[: self._n]):
                self._reason = "stop"
            elif self._n >= self.max_new_tokens:
                self._reason = "length"
        if self._reason is not None:
            return finished_step()
        return StepResult(tokens=np.array([tok], dtype=np.int64), parents=_ZERO, done=False)

    def _note_choice(self, tok: int) -> None:
        """Hook for searches that track their tokens for the processors (`SamplingSearch`)."""

    def results(self) -> list[Hypothesis]:
        if self._reason is None:
            raise RuntimeError("results() before the search is done")
        logprobs = None if self._logprobs is None else list(self._logprobs)
        return [Hypothesis(tokens=self.generated.tolist(), score=self._score, finish_reason=self._reason,
                           logprobs=logprobs)]
