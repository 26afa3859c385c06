"""Forced decoding with the translator, for every API: the log-probability of given target sentences under the
model, as CTranslate2's `Translator.score_batch` gives it (`ScoringResult`: the target's tokens with the end of
sentence last, each token's log-probability; its `cumulated_score` is their sum and `normalized_score` their mean
per token), so that a caller can rerank or score translations.

Pairs -> source and target ids (the source as `/v1/translate` reads it, so scoring a translation the service made
gives that translation's greedy score) -> `TranslationEngine.score_ids` (one encoder pass, one teacher-forced
decoder pass) on a worker thread, never the event loop, under the request's deadline: the answer is a 504 at the
deadline, and no graph run starts after it or once the client has gone. The work does not go through the
translator's scheduler (which batches searches, not forced targets), so it is not queued behind decoding; its own
backpressure is a bound on the requests each model version scores at once (`max_scoring_requests`): one more is
refused at once with the schedulers' 429 (`service.scheduling.queueing.RetryAfter`: Retry-After and retry-after-ms
from the measured rate at which slots are given back, within the refused request's deadline), and a slot is free
again only when its worker thread has finished (an abandoned request's work included).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from starlette.concurrency import run_in_threadpool

from service.errors import BadInput, Cancelled, DeadlineExceeded, ModelOutputError
from service.models.registry import LoadedModel
from service.scheduling.queueing import RetryAfter
from service.serving.awaiting import watched
from service.serving.cached import SCORE, answer
from service.serving.context import Caller
from service.serving.translate import source_ids

log = logging.getLogger(__name__)


class ScoringSlots:
    """At most `limit` scoring requests of one model version at once; one more raises QueueFull (a 429) at once,
    its retry hints from the measured rate at which slots are given back and within its deadline."""

    def __init__(self, limit: int):
        self.limit = limit
        self._free = threading.BoundedSemaphore(limit)
        self._retry = RetryAfter()

    def take(self, loaded: LoadedModel, deadline: float) -> None:
        """A slot for a request whose deadline is `deadline` (time.monotonic() seconds), or QueueFull."""
        if not self._free.acquire(blocking=False):
            raise self._retry.refusal(f"model {loaded.name} version {loaded.version} is already scoring "
                                      f"{self.limit} requests (max_scoring_requests); retry later",
                                      self.limit, self.limit, deadline - time.monotonic())

    def give(self) -> None:
        self._free.release()
        self._retry.departed()


def slots_of(request: Caller, loaded: LoadedModel) -> ScoringSlots:
    """The scoring slots of the model version `loaded`, made on its first scoring request."""
    table = getattr(request.app.state, "scoring_slots", None)
    if table is None:
        table = request.app.state.scoring_slots = {}
    key = (loaded.name, loaded.version)
    if key not in table:
        table[key] = ScoringSlots(request.app.state.settings.max_scoring_requests)
    return table[key]


@dataclass(frozen=True)
class TargetScore:
    """One target's forced decoding: its tokens (the tokenizer's pieces, EOS last) and each one's log-probability."""

    token_ids: list[int]
    tokens: list[str]
    logprobs: list[float]

    @property
    def score(self) -> float:
        """The sum of the log-probabilities: the target's log-probability (CTranslate2's `cumulated_score`)."""
        return float(sum(self.logprobs))

    @property
    def mean_logprob(self) -> float:
        """The log-probability per token, EOS included (CTranslate2's `normalized_score`)."""
        return self.score / len(self.logprobs)


@dataclass(frozen=True)
class Scored:
    """A request's scores, one per target in order, and the source tokens the encoder read (EOS included; a
    source several targets share counted once)."""

    targets: list[TargetScore]
    source_tokens: int

    @property
    def target_tokens(self) -> int:
        """The tokens scored, every target's EOS included."""
        return sum(len(t.token_ids) for t in self.targets)


@dataclass(frozen=True)
class ScorePairs:
    """The texts to score: `targets[i]` is scored against `sources[source_of[i]]`."""

    sources: list[str]
    targets: list[str]
    source_of: list[int]


def pairs_of(source: str | Sequence[str], target: str | Sequence[str]) -> ScorePairs:
    """One source and one target; one source and several targets (each scored against it, the source encoded
    once: reranking an n-best list); or as many sources as targets, in pairs. Anything else is a 400 naming
    `target`."""
    if isinstance(source, str):
        targets = [target] if isinstance(target, str) else list(target)
        return ScorePairs([source], targets, [0] * len(targets))
    if isinstance(target, str):
        raise BadInput(f"target must be a list of {len(source)} sentences, one per source, when source is a list",
                       param="target")
    if len(target) != len(source):
        raise BadInput(f"{len(target)} targets for {len(source)} sources: give one target per source, "
                       f"or one source for all the targets", param="target")
    return ScorePairs(list(source), list(target), list(range(len(source))))


def _scores(loaded: LoadedModel, pairs: ScorePairs, abandoned: threading.Event, deadline: float) -> Scored:
    """Tokenize and score (on a worker thread); a graph run never starts once the request is abandoned or past its
    deadline."""
    engine = loaded.engine
    sources = source_ids(loaded, pairs.sources, "source")  # as translate reads them
    targets = [engine.tokenizer.encode(" ".join(text.split())).ids for text in pairs.targets]
    most = engine.max_target_length - 1  # the start token takes position 0
    for index, ids in enumerate(targets):
        if len(ids) > most:
            raise BadInput(f"target {index} has {len(ids)} tokens; the model scores at most {most}",
                           param="target")

    def before_run() -> None:
        if abandoned.is_set():
            raise Cancelled("the request ended before its targets were scored")
        if time.monotonic() >= deadline:
            raise DeadlineExceeded("the request's deadline expired while its targets were being scored")

    logprobs = engine.score_ids(sources, targets, pairs.source_of, before_run)
    if bad := [i for i, row in enumerate(logprobs) if not np.isfinite(row).all()]:
        log.error("%s/%s computed non-finite log-probabilities for targets %s", loaded.name, loaded.version, bad)
        raise ModelOutputError(f"model {loaded.name} version {loaded.version} computed non-finite log-probabilities "
                               f"(NaN or infinity) for targets {bad} (0-based, in request order)")
    scored = []
    for ids, row in zip(targets, logprobs):
        token_ids = [*ids, engine.eos_id]
        scored.append(TargetScore(token_ids, [engine.tokenizer.id_to_token(t) for t in token_ids], row.tolist()))
    return Scored(scored, sum(len(ids) for ids in sources))


async def score(request: Caller, loaded: LoadedModel, pairs: ScorePairs, deadline: float) -> Scored:
    """Each target's forced decoding given its source, in order (see the module docstring); a repeat from the
    response cache where it is on (`service.serving.cached`), taking no slot."""
    return await answer(loaded, SCORE, {"pairs": pairs}, lambda: _score(request, loaded, pairs, deadline),
                        (Scored, TargetScore))


async def _score(request: Caller, loaded: LoadedModel, pairs: ScorePairs, deadline: float) -> Scored:
    slots = slots_of(request, loaded)
    slots.take(loaded, deadline)
    abandoned = threading.Event()
    # the task ends when its worker thread has (a cancelled thread pool call waits for its thread), or at once if it
    # was cancelled before it started: either way its slot is given back then
    task = asyncio.ensure_future(run_in_threadpool(_scores, loaded, pairs, abandoned, deadline))
    task.add_done_callback(lambda _: slots.give())
    return await watched(request, task, deadline, abandon=abandoned.set)
