"""The jobs the schedulers take, and what one decoding step hands back for each, after text-generation-inference's
router `Entry` (the request, where its responses go, its span's times) and its server's `Generation`.

- `TextJob` / `ImageJob`: the request a serving module submits and the handle it keeps (`future`, `cancel()`, for
  text the `on_tokens` stream callback);
- `TextPhases` / `ImagePhases`: when a job crossed each phase boundary, stamped by the scheduler's worker thread
  and read afterwards by the trace spans (`service.observability.job_spans`);
- `Generation`: one text job's outcome of one step of the batch (`TextBatch.generate_token`);
- `PromptLogprobs`: the log-probabilities of a prompt's tokens, for a job that asked (`TextJob.prompt_logprobs`).

Invariant: the scheduler's own per-job state stays in the scheduler, the batch's in the batch, and the search is
stepped by the batch alone; the scheduler reads nothing of a step but its `Generation`s.

Design notes: docs/architecture.md, service/scheduling/jobs.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from service.decoding import Hypothesis, Search, TokenLogprob
from service.scheduling.priority import DEFAULT_PRIORITY

__all__ = ["Generation", "ImageJob", "ImagePhases", "PromptLogprobs", "TextJob", "TextPhases"]


@dataclass
class TextPhases:
    """A text job's phase boundaries for its trace spans (queue_wait, prefill, decode), and how far it got."""

    admitted_at: float | None = None  # left the queue: its prefill starts
    first_token_at: float | None = None  # its first step's outcome was delivered
    finished_at: float | None = None  # its results were collected
    generated: int | None = None  # tokens generated so far by a single-row search (None: a beam search)


@dataclass
class PromptLogprobs:
    """Log-probabilities of a prompt's tokens after the first, from the prompt pass: `tokens[i]` is prompt token
    i + 1 given the tokens before it (its raw log-probability and the top alternatives of that distribution,
    computed as a generated token's are, `service.decoding.TokenLogprob`), `ranks[i]` its rank in that
    distribution (1 = the most likely; vLLM's `rank`). The first token has none: nothing comes before it."""

    tokens: list[TokenLogprob]
    ranks: list[int]


@dataclass(eq=False)
class TextJob:
    """One text request inside the scheduler. `on_tokens(new_ids, logprobs)` (optional, called on the worker
    thread) receives the tokens of a single-row search as they become final, with their `TokenLogprob`s when the
    search records them (else None); `future` resolves to the search's
    hypotheses, best first. `rows` is the most batch rows it holds (its beam width): what admission reserves.
    `prompt_logprobs`: score the prompt too, with this many top alternatives per token (None: not scored, no
    cost); the batch sets `prompt_scores` (and `cached_tokens`) from the prompt pass before the job's first tokens
    are delivered."""

    input_ids: list[int]
    search: Search  # its decoding parameters and state: stepped by the batch (`TextBatch`) alone
    mode: str  # greedy | beam | sample
    deadline: float  # time.monotonic() seconds
    on_tokens: Callable[[list[int], list[TokenLogprob] | None], None] | None = None
    future: Future = field(default_factory=Future)
    arrived: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)
    phases: TextPhases = field(default_factory=TextPhases)
    prompt_logprobs: int | None = None
    priority: int = DEFAULT_PRIORITY  # its level in the queue, lower first (`service.scheduling.priority`)
    prompt_scores: PromptLogprobs | None = field(default=None, init=False)
    cached_tokens: int = field(default=0, init=False)  # prompt tokens its prompt pass found in a prefix cache
    rows: int = field(init=False)

    def __post_init__(self) -> None:
        self.rows = self.search.max_rows
        if self.search.single_row:
            self.phases.generated = 0

    def cancel(self) -> None:
        """Ask the scheduler to drop this request; its rows are freed at the next step boundary."""
        self.cancelled.set()


@dataclass(eq=False)
class Generation:
    """What one step produced for one job (TGI's `Generation`). `rows`: the rows it was stepped on, a choice
    each; `token_ids` (with their `logprobs` when its search records them): the tokens it gained that are final,
    those of a single-row search (a beam search's become final only with its hypotheses); `hypotheses`: its
    results once `done`; `error`: what its search raised (this job fails, alone)."""

    job: TextJob
    rows: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    done: bool = False
    hypotheses: list[Hypothesis] | None = None
    error: Exception | None = None
    # a speculative step (`service.scheduling.speculation`): its draft's tokens, and those of them kept (each one a
    # token more than a plain step gives)
    drafted: int = 0
    accepted: int = 0


@dataclass
class ImagePhases:
    """An image job's phase boundaries for its trace spans (queue_wait, inference), and its batch's size."""

    started_at: float | None = None  # its batch (or first chunk) started
    finished_at: float | None = None  # its logits were ready
    batch_size: int = 0  # images in that batch (a chunked job: its chunks' size)


@dataclass(eq=False)
class ImageJob:
    """One image request inside the batcher: its preprocessed images and where their logits go."""

    pixels: np.ndarray  # (n, C, H, W) float32, already preprocessed
    deadline: float  # time.monotonic() seconds
    future: Future = field(default_factory=Future)  # resolves to logits (n, classes) float32
    arrived: float = field(default_factory=time.monotonic)
    cancelled: threading.Event = field(default_factory=threading.Event)
    phases: ImagePhases = field(default_factory=ImagePhases)
    priority: int = DEFAULT_PRIORITY  # its level in the queue, lower first (`service.scheduling.priority`)
    mode: ClassVar[str] = "classify"  # the label of its metrics and spans, where a text job has its decoding mode

    @property
    def size(self) -> int:
        """Number of images."""
        return len(self.pixels)

    def cancel(self) -> None:
        """Ask the batcher to drop this job if it has not run yet."""
        self.cancelled.set()
