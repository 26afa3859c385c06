"""Greedy decoding: one row, argmax at every step (HF ``generate(do_sample=False, num_beams=1)``).

Greedy decoding is sampling at temperature 0, as TGI's ``Greedy`` is its ``Sampling`` without the draw: the same
single-row search (`SamplingSearch`) and the same batched sampler, with no warpers and no penalties. The raw
logits go through HF's processors for greedy decoding, in ``_get_logits_processor`` order:
``no_repeat_ngram_size`` (``NoRepeatNGramLogitsProcessor``: -inf for every token that would repeat an n-gram of
prefix + generated tokens, see `NGramBlocker`), then ``min_new_tokens`` (EOS -> -inf for the first steps, like
``MinNewTokensLengthLogitsProcessor``); the token is the argmax of the result. The score and the recorded
``logprobs`` are those of `SamplingSearch`: the model's raw log-probabilities.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .sampling import SamplingSearch

__all__ = ["GreedySearch"]


class GreedySearch(SamplingSearch):
    """Argmax decoding of one sequence: a `SamplingSearch` at temperature 0 without penalties.

    ``stop_checker``, ``no_repeat_ngram_size``, ``prefix``, ``logprobs`` and ``forced_prefix``: see
    `SamplingSearch`.
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
        forced_prefix: Sequence[int] = (),
    ):
        super().__init__(max_new_tokens, eos_token_id, temperature=0.0, min_new_tokens=min_new_tokens,
                         stop_checker=stop_checker, no_repeat_ngram_size=no_repeat_ngram_size, prefix=prefix,
                         logprobs=logprobs, forced_prefix=forced_prefix)
