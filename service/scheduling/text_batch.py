"""The running batch of the text models: the engine's state for every row, the requests in row order, and where
each request's rows are. After text-generation-inference's ``Batch`` (``filter``, ``concatenate``) and its
``generate_token(batch) -> (generations, next_batch)``.

`TextBatch.prefill(backend, jobs)` builds a batch from the newcomers' prompt pass (and scores the prompts that
asked, `score_prompt`); `filter(jobs)` keeps these requests (the others' rows stay as dead rows until the next
compaction); `TextBatch.concatenate(batches)` merges batches, dropping dead rows; `generate_token()` runs one
decoding step, then every search of the batch at once, and hands back each request's outcome as a `Generation`.

Invariant: the batch is the one place that talks to the searches: the scheduler reads the `Generation`s only, and
a search that raises concerns its own request only.

Design notes: docs/architecture.md, service/scheduling/text_batch.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from service.decoding import StepResult, TokenLogprob, step_searches
from service.decoding.types import StepLogits, row_candidates
from service.decoding.distributions import log_normaliser, top_logprobs
from service.decoding.ngram_draft import NGramDrafter
from service.engines.onnx_schema import PAD_ID
from service.scheduling.jobs import Generation, PromptLogprobs, TextJob
from service.scheduling.speculation import SpeculationConfig, draft_for, speculable, step_verified

DEAD_ROWS_BEFORE_COMPACTION = 0.25  # fraction of the rows that may be dead before a step compacts the batch


class DecodingBackend(Protocol):
    """What the batch needs from an engine (`GPTEngine`, `TranslationEngine`)."""

    def prefill(self, inputs: Sequence[Sequence[int]]) -> tuple[np.ndarray, Any]: ...

    # A backend that can score prompts (the GPT) also has `prefill_positions(inputs, rows) -> (logits, state,
    # {row: logits at every position of inputs[row]})`, the same pass; the batch calls it only for such jobs. One
    # with a prefix cache has `prefill_cached(inputs, rows)`, which adds each prompt's cached tokens, and is called
    # instead of both.
    # A backend whose graphs compute each row's most likely tokens (the translator) sets `returns_row_candidates`:
    # its `prefill` and `step` take `candidates=` (`service.decoding.row_candidates`) and return `StepLogits`.

    def step(self, state: Any, tokens: np.ndarray) -> np.ndarray: ...

    def select(self, state: Any, rows: np.ndarray) -> Any: ...

    def concatenate(self, states: Sequence[Any], rows: Sequence[np.ndarray | None] | None = None) -> Any:
        """The kept `rows` of each state, stacked; the first state is consumed (its buffers may take the rest)."""

    def recycle(self, state: Any, rows: np.ndarray) -> None:
        """Rows whose content no longer matters: keep them valid for the next steps (e.g. positions in range)."""


class TextBatch:
    """Rows of `state` belong to `jobs` (in order) at `spans[job] = (first row, rows)`; rows of no job are dead.
    `pending[job]` is the job's last `StepResult`: the tokens its rows are fed next and which rows they continue;
    `handed[job]`: how many of its search's tokens a `Generation` already handed back."""

    def __init__(self, backend: DecodingBackend, state: Any, rows: int, jobs: list[TextJob],
                 spans: dict[TextJob, tuple[int, int]], pending: dict[TextJob, StepResult],
                 handed: dict[TextJob, int]):
        self.backend = backend
        self.state = state
        self.rows = rows
        self.jobs = jobs
        self.spans = spans
        self.pending = pending
        self.handed = handed
        self.drafters: dict[TextJob, NGramDrafter] = {}  # each job's n-gram drafter, once it speculated

    # n-gram speculation (`service.scheduling.speculation`): None = off, every step a plain one
    speculation: SpeculationConfig | None = None

    @classmethod
    def prefill(cls, backend: DecodingBackend, jobs: list[TextJob]) -> tuple[TextBatch, list[Generation]]:
        """The newcomers' prompt pass, their searches stepped on the first logits. The returned batch holds every
        newcomer; the caller filters out those whose generation is done or an error. Raises if the pass fails."""
        inputs = [job.input_ids for job in jobs]
        scored = [row for row, job in enumerate(jobs) if job.prompt_logprobs is not None]
        if hasattr(backend, "prefill_cached"):  # the GPT: from cached prefixes, counted per job
            logits, state, every, cached = backend.prefill_cached(inputs, scored)
            for job, tokens in zip(jobs, cached):
                job.cached_tokens = tokens
            for row in scored:
                jobs[row].prompt_scores = score_prompt(inputs[row], every[row], jobs[row].prompt_logprobs)
        elif scored:
            logits, state, every = backend.prefill_positions(inputs, scored)
            for row in scored:
                jobs[row].prompt_scores = score_prompt(inputs[row], every[row], jobs[row].prompt_logprobs)
        elif getattr(backend, "returns_row_candidates", False):
            logits, state = backend.prefill(inputs, candidates=row_candidates([job.search for job in jobs]))
        else:
            logits, state = backend.prefill(inputs)
        batch = cls(backend, state, len(jobs), list(jobs), {job: (row, 1) for row, job in enumerate(jobs)}, {},
                    {job: 0 for job in jobs})
        return batch, batch._step_searches(logits)

    @property
    def live_rows(self) -> int:
        return sum(rows for _, rows in self.spans.values())

    def row_indices(self) -> np.ndarray:
        """The rows of the batch's requests, in order (everything else is dead)."""
        if not self.jobs:
            return np.zeros(0, np.int64)
        return np.concatenate([np.arange(first, first + rows) for first, rows in map(self.spans.get, self.jobs)])

    def filter(self, jobs: list[TextJob]) -> TextBatch:
        """Keep `jobs` (a subset of this batch's, in order); the others' rows become dead rows."""
        kept = set(jobs)
        self.spans = {job: span for job, span in self.spans.items() if job in kept}
        self.pending = {job: step for job, step in self.pending.items() if job in kept}
        self.handed = {job: count for job, count in self.handed.items() if job in kept}
        self.drafters = {job: drafter for job, drafter in self.drafters.items() if job in kept}
        self.jobs = list(jobs)
        return self

    @staticmethod
    def concatenate(batches: Sequence[TextBatch]) -> TextBatch:
        """One batch holding every request of `batches`, in order, dead rows dropped; the first batch is consumed
        (its state may hold the result: `DecodingBackend.concatenate`)."""
        batches = [b for b in batches if b.jobs] or list(batches[-1:])
        if len(batches) == 1 and batches[0].live_rows == batches[0].rows:
            return batches[0]
        first = batches[0]
        state = first.backend.concatenate([b.state for b in batches], rows=[b.row_indices() for b in batches])
        jobs, spans, pending, handed, row = [], {}, {}, {}, 0
        for batch in batches:
            for job in batch.jobs:
                rows = batch.spans[job][1]
                jobs.append(job)
                spans[job] = (row, rows)
                row += rows
            pending.update(batch.pending)
            handed.update(batch.handed)
        merged = TextBatch(first.backend, state, row, jobs, spans, pending, handed)
        merged.speculation = first.speculation
        for batch in batches:
            merged.drafters.update(batch.drafters)
        return merged

    def generate_token(self) -> list[Generation]:
        """One decoding step: feed every request's pending tokens, then step every search. Returns one
        `Generation` per job, in order. Raises if the engine step fails (the state is unusable then). A batch that
        may speculate verifies its rows' drafts instead (`_speculate`), several tokens a row."""
        if speculable(self.backend, self.jobs, self.live_rows, self.speculation):
            drafts = {job: draft_for(job, self._drafter(job), self.speculation, self.backend.context_length)
                      for job in self.jobs}
            if any(drafts.values()):
                return self._speculate(drafts)
        parents, tokens = self._plan()
        self.state = self.backend.select(self.state, parents)
        if getattr(self.backend, "returns_row_candidates", False):
            candidates = row_candidates([job.search for job in self.jobs])
            logits = self.backend.step(self.state, tokens, candidates=candidates)  # StepLogits of the rows
        else:
            logits = self.backend.step(self.state, tokens)  # (rows, V)
        if self.live_rows < self.rows:
            rows = self.row_indices()
            logits = logits.take(rows) if isinstance(logits, StepLogits) else logits[rows]
        return self._step_searches(logits)

    def _drafter(self, job: TextJob) -> NGramDrafter:
        drafter = self.drafters.get(job)
        if drafter is None:
            drafter = self.drafters[job] = NGramDrafter(job.input_ids)
        return drafter

    def _speculate(self, drafts: dict[TextJob, list[int]]) -> list[Generation]:
        """One verify pass feeding every row its pending token and its job's draft, every search stepped on its
        positions while it agrees with its draft (`step_verified`), each row's cache rolled back past the first
        disagreement; one `Generation` per job, in order, with its drafted and accepted tokens."""
        parents, tokens = self._plan()
        self.state = self.backend.select(self.state, parents)
        fed = [[token] for token in tokens.tolist()]  # dead rows: their padding token alone, nothing kept
        rows = [self.spans[job][0] for job in self.jobs]
        for job, row in zip(self.jobs, rows):
            fed[row] += drafts[job]
        verification = self.backend.verify(self.state, fed)
        outcomes, kept = step_verified([job.search for job in self.jobs], verification.logits[rows],
                                       [fed[row] for row in rows])
        keep = np.zeros(self.rows, np.int64)
        keep[rows] = kept
        verification.commit(keep)
        generations = []
        for job, outcome, count in zip(self.jobs, outcomes, kept.tolist()):
            drafted, accepted = len(drafts[job]), count - 1  # accepted: draft tokens kept in the cache
            self.drafters[job].record(drafted, accepted)
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                self.pending[job] = outcome
                generation = self._generation(job, 1, outcome.done)
                generation.drafted, generation.accepted = drafted, accepted
            except Exception as error:  # its search raised (stepping, or collecting its results)
                generation = Generation(job, 1, error=error)
            generations.append(generation)
        return generations

    def _plan(self) -> tuple[np.ndarray, np.ndarray]:
        """Parents and tokens of the next step's rows; moves the requests' spans when the batch is compacted."""
        steps = [self.pending[job] for job in self.jobs]
        dead = self.rows - self.live_rows
        in_place = dead <= self.rows * DEAD_ROWS_BEFORE_COMPACTION and all(
            len(step.tokens) == self.spans[job][1] for job, step in zip(self.jobs, steps))
        if in_place:
            parents, tokens = np.arange(self.rows), np.full(self.rows, PAD_ID, np.int64)  # dead rows: never read
            single_rows, single_tokens = [], []  # a single-row search's row continues itself: its parent is in place
            for job, step in zip(self.jobs, steps):
                first, rows = self.spans[job]
                if job.search.single_row:
                    single_rows.append(first)
                    single_tokens.append(step.tokens[0])
                else:
                    parents[first : first + rows], tokens[first : first + rows] = step.parents + first, step.tokens
            tokens[single_rows] = single_tokens
            if dead:
                self.backend.recycle(self.state, np.setdiff1d(np.arange(self.rows), self.row_indices()))
            return parents, tokens
        parents = np.concatenate([step.parents + self.spans[job][0] for job, step in zip(self.jobs, steps)])
        tokens = np.concatenate([step.tokens for step in steps])
        row = 0
        for job, step in zip(self.jobs, steps):
            self.spans[job] = (row, len(step.tokens))
            row += len(step.tokens)
        self.rows = row
        return parents, tokens

    def _step_searches(self, logits: np.ndarray | StepLogits) -> list[Generation]:
        """Step every search on its rows of `logits` (rows, V) or `StepLogits`, in job order; one `Generation` per
        job."""
        fed = [self.spans[job][1] for job in self.jobs]  # the rows each job was stepped on
        outcomes = step_searches([job.search for job in self.jobs], logits, isolate=True)
        generations = []
        for job, rows, outcome in zip(self.jobs, fed, outcomes):
            try:
                if isinstance(outcome, Exception):
                    raise outcome
                self.pending[job] = outcome
                generations.append(self._generation(job, rows, outcome.done))
            except Exception as error:  # its search raised (stepping, or collecting its results)
                generations.append(Generation(job, rows, error=error))
        return generations

    def _generation(self, job: TextJob, rows: int, done: bool) -> Generation:
        """The job's new final tokens (a single-row search's, with their log-probabilities when recorded) and,
        once done, its hypotheses."""
        search, ids, logprobs = job.search, [], None
        if search.single_row:
            start, generated = self.handed[job], search.generated
            ids = generated[start:].tolist()
            self.handed[job] = len(generated)
            if search.token_logprobs:
                logprobs = search.token_logprobs[start : start + len(ids)]
        return Generation(job, rows, ids, logprobs, done, search.results() if done else None)


def score_prompt(prompt: Sequence[int], logits: np.ndarray, top: int) -> PromptLogprobs:
    """The log-probabilities of `prompt`'s tokens after the first, from the logits at each of its positions
    (len(prompt), V): token t + 1 under position t's distribution, with its rank and the `top` most likely
    tokens there. The same float64 operations as a generated token's (`service.decoding.sampling`), so a token
    that is the most likely has exactly the top alternative's log-probability."""
    x = np.asarray(logits[:-1], dtype=np.float64)  # (T - 1, V): the last position predicts the first new token
    targets = np.asarray(prompt[1:], dtype=np.int64)
    peak, log_z = log_normaliser(x)
    chosen = x[np.arange(len(targets)), targets]  # (T - 1,)
    values = ((chosen - peak) - log_z).tolist()
    ranks = (1 + np.count_nonzero(x > chosen[:, None], axis=1)).tolist()
    tokens = [TokenLogprob(token, value, top_logprobs(x[t], top, peak[t], log_z[t]) if top else [])
              for t, (token, value) in enumerate(zip(targets.tolist(), values))]
    return PromptLogprobs(tokens, ranks)
