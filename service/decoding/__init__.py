"""Decoding strategies (numpy only): greedy, sampling and HF-compatible beam search over KV-cache rows.

See `service.decoding.base` for the row protocol shared by the searches, the batching scheduler and
`run_search`, the reference offline driver.
"""

from .base import (
    Hypothesis,
    Search,
    StepResult,
    StopStrings,
    TokenLogprob,
    eos_ids,
    log_softmax,
    run_search,
    truncate_at_stop,
)
from .beam import BeamSearch
from .greedy import GreedySearch
from .sampling import (
    SamplingSearch,
    apply_openai_penalties,
    apply_repetition_penalty,
    apply_temperature,
    top_k_filter,
    top_p_filter,
)

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
    "top_k_filter",
    "top_p_filter",
    "truncate_at_stop",
]
