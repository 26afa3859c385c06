"""Decoding strategies (numpy only): greedy, sampling and HF-compatible beam search over KV-cache rows.

- types.py: the `Search` protocol shared by the searches, the batching scheduler and `run_search`, with its
  `StepResult`, `Hypothesis` and `TokenLogprob`;
- distributions.py: log-softmax, softmax and top-k (one copy for the whole service);
- processors.py: HF's logits processors and OpenAI's penalties as array functions;
- sampler.py: the batched sampler over row state as arrays (greedy = temperature 0);
- sampling.py, greedy.py, beam.py: the searches; ngrams.py: the n-gram ban they share;
- forced_prefix.py: the tokens a search emits before it chooses any (a translation's ``target_prefix``);
- stops.py: stop strings; detokenize.py: a row's incremental text (stop strings, streams, text offsets);
- batch_step.py: `step_searches` steps every search of a batch at once (the batched sampler for single-row
  searches, one log-softmax for all beam rows) and `run_search` is the offline driver built on it.
"""

from .batch_step import run_search, step_searches
from .beam import BeamSearch
from .detokenize import Detokenizer, text_offsets
from .distributions import log_softmax, softmax, top_k_indices
from .greedy import GreedySearch
from .processors import (
    apply_openai_penalties,
    apply_repetition_penalty,
    apply_temperature,
    top_k_filter,
    top_p_filter,
)
from .sampling import SamplingSearch
from .stops import StopStrings, truncate_at_stop
from .types import Hypothesis, Search, StepResult, TokenLogprob, eos_ids

__all__ = [
    "BeamSearch",
    "Detokenizer",
    "GreedySearch",
    "Hypothesis",
    "SamplingSearch",
    "Search",
    "StepResult",
    "StopStrings",
    "TokenLogprob",
    "apply_openai_penalties",
    "apply_repetition_penalty",
    "apply_temperature",
    "eos_ids",
    "log_softmax",
    "run_search",
    "softmax",
    "step_searches",
    "text_offsets",
    "top_k_filter",
    "top_k_indices",
    "top_p_filter",
    "truncate_at_stop",
]
