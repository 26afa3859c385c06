"""Text generation with the GPT, for every API (native `/v1/generate`, OpenAI completions and chat): protocol-
neutral parameters -> one search per choice -> the model's continuous batcher -> completions, or a stream.

- `n` choices per prompt are `n` independent jobs (sampling seeds `seed + i`, so one seed gives one text per
  choice, reproducibly); with `num_beams > 1` one beam search returns the `n` best hypotheses instead.
- `best_of > n` samples `best_of` choices and keeps the `n` with the highest log-probability per token (OpenAI's
  ranking). The OpenAI adapter maps `best_of` with temperature 0 to beam search (`num_beams = best_of`).
- `prompt_logprobs`: the prompt's log-probabilities too, from the prompt pass (`TextJob.prompt_logprobs`), computed
  once per prompt (by its first choice's job) and given to every choice; `max_new_tokens` 0 scores the prompt
  only (`ScoreOnly`: one job per prompt, nothing generated, finish reason "length", each choice the same).
- Prompts are tokenized on a worker thread (`encode_prompts`), never on the event loop.
- Everything waits under the request's deadline and watches its client (`service.serving.awaiting`).
- A `constraint` (JSON schema, regex, choice, grammar) is compiled first (`service.serving.constrain`, which a
  stream's caller awaits before `stream`); each choice constrains its own copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool

import numpy as np

from service.decoding import BeamSearch, Hypothesis, SamplingSearch, Search, StepResult, StopStrings
from service.decoding.constraints import Compiled, Constraint
from service.decoding.types import finished_step
from service.errors import BadInput
from service.models.registry import LoadedModel
from service.scheduling.jobs import TextJob
from service.serving.awaiting import run_text_jobs
from service.serving.cached import COMPLETION_TYPES, GENERATE, answer, answer_stream
from service.serving.constrain import compile_constraint, row_constraint
from service.serving.context import Caller, check_new_tokens, priority_level
from service.serving.outputs import Completion, completion_from
from service.serving.streaming import (
    Finished,
    IncrementalText,
    Piece,
    stream_jobs,
)


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    seed: int | None = None
    stop: Sequence[str] = field(default_factory=tuple)
    num_beams: int = 1
    logprobs: int | None = None  # top-N log-probabilities per token (None: none; 0: the chosen token's only)
    prompt_logprobs: int | None = None  # the prompt's too, top-N per token (None: not computed)
    constraint: Constraint | None = None  # what the output must match (`service.decoding.constraints`)
    compiled: Compiled | None = field(default=None, compare=False)  # the constraint compiled (`compile_constraint`)
    priority: int | None = None  # its queue level (`service.scheduling.priority`); None: the model's default

    @property
    def mode(self) -> str:
        """The metrics' decoding mode."""
        return "beam" if self.num_beams > 1 else "greedy" if self.temperature == 0 else "sample"

    @property
    def deterministic(self) -> bool:
        """Whether the output is a function of the request (what the response cache needs): beams, greedy, a seed,
        or nothing generated; sampling without a seed is not."""
        return self.num_beams > 1 or self.temperature == 0 or self.seed is not None or self.max_new_tokens == 0


async def encode_prompts(loaded: LoadedModel, prompts: Sequence[str | Sequence[int]],
                         max_new_tokens: int, tokens_field: str = "max_new_tokens") -> list[list[int]]:
    """`encode_prompt` of every prompt, on a worker thread: tokenizing is CPU work the event loop must not wait on."""
    return await run_in_threadpool(lambda: [encode_prompt(loaded, prompt, max_new_tokens, tokens_field)
                                            for prompt in prompts])


def encode_prompt(loaded: LoadedModel, prompt: str | Sequence[int], max_new_tokens: int,
                  tokens_field: str = "max_new_tokens") -> list[int]:
    """The prompt's token ids (a string is encoded; ids are checked against the vocabulary), which with
    `max_new_tokens` must fit the model's context (400 otherwise, naming `tokens_field`: the request field that holds
    `max_new_tokens` in the API that was called). A string is tokenized by the calling thread: from a route, use
    `encode_prompts`."""
    engine = loaded.engine
    if isinstance(prompt, str):
        ids = engine.tokenizer.encode(prompt).ids
    else:
        ids = [int(token) for token in prompt]
        if any(not 0 <= token < engine.vocab_size for token in ids):
            raise BadInput(f"prompt: token ids must be in [0, {engine.vocab_size})")
    if not ids:
        raise BadInput("prompt: empty")
    if len(ids) + max_new_tokens > engine.context_length:
        raise BadInput(f"prompt ({len(ids)} tokens) + {tokens_field} ({max_new_tokens}) exceeds the model's context of "
                       f"{engine.context_length} tokens", param=tokens_field)
    return ids


class ScoreOnly(Search):
    """Generate nothing (`max_new_tokens` 0: the prompt is only scored): done on the prompt pass's logits, with
    one empty hypothesis (finish reason "length", as a budget of 0 tokens is spent)."""

    def __init__(self, logprobs: int | None = None):
        self.logprobs = logprobs  # None: the hypothesis records no log-probabilities, as a search asked for none
        self._done = False

    @property
    def num_rows(self) -> int:
        return 0 if self._done else 1

    @property
    def done(self) -> bool:
        return self._done

    def step(self, logits: np.ndarray) -> StepResult:
        self._done = True
        return finished_step()

    def step_rows(self, x: np.ndarray, peak: np.ndarray, log_z: np.ndarray) -> StepResult:
        """How the batch steps a search of several rows (`service.decoding.step_searches`): the same."""
        return self.step(x)

    def results(self) -> list[Hypothesis]:
        if not self._done:
            raise RuntimeError("results() before the search is done")
        return [Hypothesis([], 0.0, "length", logprobs=None if self.logprobs is None else [])]


def _search(loaded: LoadedModel, prompt: list[int], params: GenerationParams, choice: int) -> Search:
    """The search of a streamed choice `choice` (`ScoreOnly` when nothing is to be generated)."""
    if params.max_new_tokens == 0:
        return ScoreOnly(params.logprobs)
    return _sampling_search(loaded, prompt, params, choice)


def _sampling_search(loaded: LoadedModel, prompt: list[int], params: GenerationParams, choice: int) -> Search:
    engine = loaded.engine
    seed = None if params.seed is None else params.seed + choice
    return SamplingSearch(params.max_new_tokens, engine.eos_id, temperature=params.temperature, top_k=params.top_k,
                          top_p=params.top_p, repetition_penalty=params.repetition_penalty,
                          presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                          min_new_tokens=params.min_new_tokens, seed=seed, prefix=prompt,
                          no_repeat_ngram_size=params.no_repeat_ngram_size, logprobs=params.logprobs,
                          stop_checker=StopStrings(params.stop, engine.tokenizer.decode) if params.stop else None,
                          constraint=row_constraint(params))


def _jobs(loaded: LoadedModel, prompt: list[int], params: GenerationParams, samples: int, n: int,
          deadline: float) -> list[TextJob]:
    """The prompt's jobs; the first scores the prompt when its log-probabilities are asked for."""
    queued = {"priority": priority_level(loaded, params.priority)}
    scored = {**queued, "prompt_logprobs": params.prompt_logprobs}
    if params.max_new_tokens == 0:
        return [TextJob(prompt, ScoreOnly(params.logprobs), params.mode, deadline, **scored)]
    if params.num_beams > 1:
        search = BeamSearch(params.num_beams, params.max_new_tokens, loaded.engine.eos_id, prefix=prompt,
                            min_new_tokens=params.min_new_tokens, num_return_sequences=n,
                            no_repeat_ngram_size=params.no_repeat_ngram_size)
        return [TextJob(prompt, search, params.mode, deadline, **scored)]
    return [TextJob(prompt, _sampling_search(loaded, prompt, params, i), params.mode, deadline,
                    **(scored if i == 0 else queued)) for i in range(samples)]


def check_prompt_scoring(loaded: LoadedModel, params: GenerationParams) -> None:
    """400 when the prompt's log-probabilities are asked of a model version whose prompt pass does not return
    every position's logits (`GPTEngine.scores_prompts`)."""
    if params.prompt_logprobs is not None and not getattr(loaded.engine, "scores_prompts", False):
        raise BadInput(f"{loaded.name} version {loaded.version} cannot score prompts: its decoder graph returns the "
                       "last position's logits only", param="logprobs")


async def generate(request: Caller, loaded: LoadedModel, prompts: Sequence[list[int]], params: GenerationParams,
                   deadline: float, n: int = 1, best_of: int | None = None) -> list[list[Completion]]:
    """`n` completions per prompt (best first when ranked: beams, or `best_of` samples); a repeat of a deterministic
    request from the response cache where it is on (`service.serving.cached`)."""
    priority_level(loaded, params.priority)  # a level out of range is a 400, cached answer or not
    fields = {"prompts": prompts, "params": params, "n": n, "samples": max(n, best_of or n)}

    async def compute() -> list[list[Completion]]:
        return await _generate(request, loaded, prompts, params, deadline, n, best_of)

    return await answer(loaded, GENERATE, fields, compute, COMPLETION_TYPES, cacheable=params.deterministic)


async def _generate(request: Caller, loaded: LoadedModel, prompts: Sequence[list[int]], params: GenerationParams,
                    deadline: float, n: int, best_of: int | None) -> list[list[Completion]]:
    check_new_tokens(params.min_new_tokens, params.max_new_tokens)
    check_prompt_scoring(loaded, params)
    params = await compile_constraint(loaded, params)
    if params.num_beams > 1 and n > params.num_beams:
        raise BadInput(f"n / num_return_sequences ({n}) must be <= num_beams ({params.num_beams})")
    samples = max(n, best_of or n)
    per_prompt = [_jobs(loaded, prompt, params, samples, n, deadline) for prompt in prompts]
    jobs = [job for group in per_prompt for job in group]
    results = await run_text_jobs(request, loaded, jobs, deadline)
    decode = loaded.engine.tokenizer.decode
    out, i = [], 0
    for prompt, group in zip(prompts, per_prompt):
        scores = group[0].prompt_scores
        completions = [completion_from(h, decode, params.stop, len(prompt), scores, group[0].cached_tokens)
                       for hypotheses in results[i : i + len(group)] for h in hypotheses]
        i += len(group)
        if params.max_new_tokens == 0:  # scored once: every choice is the same
            completions = [dataclasses.replace(completions[0]) for _ in range(n)]
        elif samples > n:  # OpenAI's best_of: the n samples with the highest log-probability per token
            completions = sorted(completions, key=lambda c: -c.mean_logprob)
        out.append(completions[:n])
    return out


async def stream(loaded: LoadedModel, prompts: Sequence[list[int]], params: GenerationParams, deadline: float,
                 n: int = 1) -> AsyncIterator[list[Piece | Finished]]:
    """Stream `n` sampled (or greedy) choices per prompt; choice `p * n + i` is prompt p's i-th. Submitted now (or
    replayed from the response cache: `service.serving.cached`): a constraint must be compiled already
    (`compile_constraint`)."""
    check_new_tokens(params.min_new_tokens, params.max_new_tokens)
    if params.num_beams > 1:
        raise BadInput("stream needs num_beams=1")
    if params.prompt_logprobs is not None:
        raise BadInput("a stream does not carry the prompt's log-probabilities", param="stream")
    priority = priority_level(loaded, params.priority)
    fields = {"prompts": prompts, "params": params, "n": n, "samples": n}  # the key of the same request unstreamed

    async def start() -> AsyncIterator[list[Piece | Finished]]:
        return _stream(loaded, prompts, params, deadline, n, priority)

    return await answer_stream(loaded, GENERATE, fields, start, len(prompts), n, cacheable=params.deterministic)


def _stream(loaded: LoadedModel, prompts: Sequence[list[int]], params: GenerationParams, deadline: float, n: int,
            priority: int) -> AsyncIterator[list[Piece | Finished]]:
    jobs = [TextJob(prompt, _search(loaded, prompt, params, i), params.mode, deadline, priority=priority)
            for prompt in prompts for i in range(n)]
    tokenizer = loaded.engine.tokenizer
    texts = [IncrementalText(tokenizer, params.stop) for _ in jobs]

    def complete(choice: int, hypothesis) -> Completion:
        first = jobs[choice - choice % n]  # its prompt's first choice: the prompt's cached tokens (`usage`)
        return completion_from(hypothesis, tokenizer.decode, params.stop, len(first.input_ids), None,
                               first.cached_tokens)

    return stream_jobs(loaded, jobs, texts, complete)
