"""Text generation with the GPT, for every API (native `/v1/generate`, OpenAI completions and chat): protocol-
neutral parameters -> one search per choice -> the model's continuous batcher -> completions, or a stream.

- `n` choices per prompt are `n` independent jobs (sampling seeds `seed + i`, so one seed gives one text per
  choice, reproducibly); with `num_beams > 1` one beam search returns the `n` best hypotheses instead.
- `best_of > n` samples `best_of` choices and keeps the `n` with the highest log-probability per token (OpenAI's
  ranking). The OpenAI adapter maps `best_of` with temperature 0 to beam search (`num_beams = best_of`).
- Prompts are tokenized on a worker thread (`encode_prompts`), never on the event loop.
- Everything waits under the request's deadline and watches its client (`service.serving.awaiting`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from service.decoding import BeamSearch, SamplingSearch, Search, StopStrings
from service.errors import BadInput
from service.models.registry import LoadedModel
from service.scheduling.jobs import TextJob
from service.serving.awaiting import run_text_jobs
from service.serving.context import check_new_tokens
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

    @property
    def mode(self) -> str:
        """The metrics' decoding mode."""
        return "beam" if self.num_beams > 1 else "greedy" if self.temperature == 0 else "sample"


async def encode_prompts(loaded: LoadedModel, prompts: Sequence[str | Sequence[int]],
                         max_new_tokens: int) -> list[list[int]]:
    """`encode_prompt` of every prompt, on a worker thread: tokenizing is CPU work the event loop must not wait on."""
    return await run_in_threadpool(lambda: [encode_prompt(loaded, prompt, max_new_tokens) for prompt in prompts])


def encode_prompt(loaded: LoadedModel, prompt: str | Sequence[int], max_new_tokens: int) -> list[int]:
    """The prompt's token ids (a string is encoded; ids are checked against the vocabulary), which with
    `max_new_tokens` must fit the model's context (400 otherwise). A string is tokenized by the calling thread:
    from a route, use `encode_prompts`."""
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
        raise BadInput(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
                       f"of {engine.context_length} tokens")
    return ids


def _sampling_search(loaded: LoadedModel, prompt: list[int], params: GenerationParams, choice: int) -> Search:
    engine = loaded.engine
    seed = None if params.seed is None else params.seed + choice
    return SamplingSearch(params.max_new_tokens, engine.eos_id, temperature=params.temperature, top_k=params.top_k,
                          top_p=params.top_p, repetition_penalty=params.repetition_penalty,
                          presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                          min_new_tokens=params.min_new_tokens, seed=seed, prefix=prompt,
                          no_repeat_ngram_size=params.no_repeat_ngram_size, logprobs=params.logprobs,
                          stop_checker=StopStrings(params.stop, engine.tokenizer.decode) if params.stop else None)


def _jobs(loaded: LoadedModel, prompt: list[int], params: GenerationParams, samples: int, n: int,
          deadline: float) -> list[TextJob]:
    if params.num_beams > 1:
        search = BeamSearch(params.num_beams, params.max_new_tokens, loaded.engine.eos_id, prefix=prompt,
                            min_new_tokens=params.min_new_tokens, num_return_sequences=n,
                            no_repeat_ngram_size=params.no_repeat_ngram_size)
        return [TextJob(prompt, search, params.mode, deadline)]
    return [TextJob(prompt, _sampling_search(loaded, prompt, params, i), params.mode, deadline)
            for i in range(samples)]


async def generate(request: Request, loaded: LoadedModel, prompts: Sequence[list[int]], params: GenerationParams,
                   deadline: float, n: int = 1, best_of: int | None = None) -> list[list[Completion]]:
    """`n` completions per prompt (best first when ranked: beams, or `best_of` samples)."""
    check_new_tokens(params.min_new_tokens, params.max_new_tokens)
    if params.num_beams > 1 and n > params.num_beams:
        raise BadInput(f"n / num_return_sequences ({n}) must be <= num_beams ({params.num_beams})")
    samples = max(n, best_of or n)
    per_prompt = [_jobs(loaded, prompt, params, samples, n, deadline) for prompt in prompts]
    jobs = [job for group in per_prompt for job in group]
    results = await run_text_jobs(request, loaded, jobs, deadline)
    decode = loaded.engine.tokenizer.decode
    out, i = [], 0
    for prompt, group in zip(prompts, per_prompt):
        completions = [completion_from(h, decode, params.stop, len(prompt))
                       for hypotheses in results[i : i + len(group)] for h in hypotheses]
        i += len(group)
        if samples > n:  # OpenAI's best_of: the n samples with the highest log-probability per token
            completions = sorted(completions, key=lambda c: -c.mean_logprob)
        out.append(completions[:n])
    return out


def stream(loaded: LoadedModel, prompts: Sequence[list[int]], params: GenerationParams, deadline: float,
           n: int = 1) -> AsyncIterator[list[Piece | Finished]]:
    """Stream `n` sampled (or greedy) choices per prompt; choice `p * n + i` is prompt p's i-th. Submitted now."""
    check_new_tokens(params.min_new_tokens, params.max_new_tokens)
    if params.num_beams > 1:
        raise BadInput("stream needs num_beams=1")
    jobs = [TextJob(prompt, _sampling_search(loaded, prompt, params, i), params.mode, deadline)
            for prompt in prompts for i in range(n)]
    tokenizer = loaded.engine.tokenizer
    texts = [IncrementalText(tokenizer, params.stop) for _ in jobs]

    def complete(choice: int, hypothesis) -> Completion:
        return completion_from(hypothesis, tokenizer.decode, params.stop, len(jobs[choice].input_ids))

    return stream_jobs(loaded, jobs, texts, complete)
