"""The types every decoding strategy shares: the `Search` protocol, its `StepResult`s and finished `Hypothesis`es.

A search is a small per-request state machine over *rows* (rows of a KV cache): a driver runs the model for all
rows of all active searches, hands each search the next-token logits of its own rows, and the search answers with
the tokens to append and, for every new row, which current row it continues (`parents`), so beam reordering and
dropping finished rows are one row-selection operation on the cache. Protocol (a complete driver:
`service.decoding.batch_step.run_search`): a new search needs one row, the *prefill row*, and its first ``step``
gets that row's last-position logits (1, V); each ``step(logits)`` returns a `StepResult`, new row ``i`` = row
``parents[i]`` + ``tokens[i]``; once ``done``, ``results()`` gives the finished hypotheses, best first.

The strategies follow Hugging Face transformers ``generate()`` semantics (greedy, multinomial sampling and the
vectorised beam search of transformers 5.x). Everything is numpy: no torch, no ONNX, no asyncio.

Design notes (the protocol step by step): docs/architecture.md, service/decoding/types.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["FINISH_REASONS", "Hypothesis", "Search", "StepLogits", "StepResult", "TokenLogprob", "eos_ids",
           "finished_step", "row_candidates"]

FINISH_REASONS = ("eos", "length", "stop")  # the values of `Hypothesis.finish_reason`


@dataclass(slots=True)
class TokenLogprob:
    """Log-probabilities recorded for one generated token (OpenAI ``logprobs`` / ``top_logprobs``).

    All values come from the model's RAW distribution at that position: log-softmax of the unprocessed logits
    the search received (before penalties, n-gram ban, EOS masking, temperature, top-k/top-p), the same quantity
    the hypothesis score sums. ``logprob`` is that of the chosen ``token_id``; ``top`` holds the N most likely
    tokens as (token id, log-prob), best first, ties by lower id first (empty for N = 0). A log-prob may be
    ``-inf`` where the raw logits hold -inf (JSON has no -inf: the serving layer must map it).
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Hypothesis:
    """One finished output sequence.

    ``tokens`` are the generated tokens only (no prompt, no decoder start token, EOS excluded); ``score`` is the
    strategy's score (sum of log-probs, length-normalised for beam search); ``finish_reason`` is one of
    "eos" | "length" | "stop"; ``text`` is left for callers that detokenise. ``logprobs``: one `TokenLogprob`
    per entry of ``tokens`` when the search recorded them (``GreedySearch``/``SamplingSearch`` with
    ``logprobs=N``), else None (always None for beam search).
    """

    tokens: list[int]
    score: float
    finish_reason: str
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class StepResult:
    """Answer of one `Search.step`: new row ``i`` = current row ``parents[i]`` + ``tokens[i]``.

    ``tokens`` and ``parents`` are int64 arrays of shape (new_rows,); ``parents`` index the rows whose logits
    were passed to `step`. ``done`` means the search is finished and ``new_rows == 0``.
    """

    tokens: np.ndarray
    parents: np.ndarray
    done: bool


_EMPTY = np.zeros(0, dtype=np.int64)


def finished_step() -> StepResult:
    """The `StepResult` of a search that has just finished (no rows left)."""
    return StepResult(tokens=_EMPTY.copy(), parents=_EMPTY.copy(), done=True)


def eos_ids(eos_token_id: int | Sequence[int] | None) -> np.ndarray:
    """Normalise an EOS id (int, several ids or None) to an int64 array of shape (n_eos,)."""
    if eos_token_id is None:
        return _EMPTY.copy()
    if isinstance(eos_token_id, (int, np.integer)):
        return np.array([int(eos_token_id)], dtype=np.int64)
    return np.asarray(list(eos_token_id), dtype=np.int64).reshape(-1)


@dataclass(frozen=True, slots=True)
class StepLogits:
    """A step's model output for its rows: the raw next-token ``logits`` (rows, V) and, from a graph that computes
    them (`service.engines.row_candidates`), each row's ``k`` most likely tokens: ``top_logprobs`` (rows, k) float32
    log-softmax values, best first, and their ``top_ids`` (rows, k) int64, ties by lower id. A beam search whose
    `Search.row_candidates` is at most ``k`` chooses among these; everything else reads ``logits``."""

    logits: np.ndarray
    top_logprobs: np.ndarray
    top_ids: np.ndarray

    @property
    def k(self) -> int:
        return self.top_ids.shape[1]

    def take(self, rows: np.ndarray) -> StepLogits:
        """These rows only, in this order."""
        return StepLogits(self.logits[rows], self.top_logprobs[rows], self.top_ids[rows])


class Search(ABC):
    """A per-request decoding state machine (see the module docstring for the protocol)."""

    @property
    @abstractmethod
    def num_rows(self) -> int:
        """Rows this search needs in the cache for its next `step` (1 before the first step, 0 once done)."""

    single_row = False  # True: one row from start to end, stepped by the batched sampler (`step_searches`)

    @property
    def max_rows(self) -> int:
        """The most rows this search holds at once (its beam width): what a scheduler reserves for it."""
        return 1

    @property
    def row_candidates(self) -> int:
        """How many most likely tokens per row its next step chooses among when the model hands them over
        (`StepLogits`): 0 for a search that reads the whole distribution."""
        return 0

    @property
    @abstractmethod
    def done(self) -> bool:
        """Whether the search has finished; `results` is valid from then on."""

    @abstractmethod
    def step(self, logits: np.ndarray) -> StepResult:
        """Consume next-token logits (num_rows, V), raw and un-normalised, and choose the next rows."""

    @abstractmethod
    def results(self) -> list[Hypothesis]:
        """Finished hypotheses, best first (valid once `done`)."""


def row_candidates(searches: Sequence[Search]) -> int:
    """The most likely tokens per row a step of ``searches`` hands over: the most any of them chooses among."""
    return max((search.row_candidates for search in searches if not search.done), default=0)


def isolated(function: Callable[..., StepResult | None], *arguments) -> StepResult | Exception | None:
    """``function(*arguments)``, or the exception it raised: a search's step fails its request only."""
    try:
        return function(*arguments)
    except Exception as error:  # noqa: BLE001 - handed back to the caller, who fails that request only
        return error
