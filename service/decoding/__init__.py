"""Decoding strategies (numpy only): greedy, sampling and HF-compatible beam search over KV-cache rows.

See `service.decoding.base` for the row protocol shared by the searches, the batching scheduler and
`run_search`, the reference offline driver; `step_searches` steps every search of a batch at once (the batched
sampler for single-row searches, one log-softmax for all beam rows).
"""

from .base import (
    Hypothesis,
    Search,
    StepResult,
    StopStrings,
    TokenLogprob,
    eos_ids,
    log_softmax,
    truncate_at_stop,
)
from .batch_step import run_search, step_searches
from .beam import BeamSearch
from .greedy import GreedySearch
from .processors import (
    apply_openai_penalties,
    apply_repetition_penalty,
    apply_temperature,
    top_k_filter,
    top_p_filter,
)
from .sampling import SamplingSearch

__all__ = [
    "BeamSearch",
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
    "step_searches",
    "top_k_filter",
    "top_p_filter",
    "truncate_at_stop",
]
