"""German -> English translation, for every API: protocol-neutral parameters -> one search per text (the texts
tokenized on a worker thread, not the event loop) -> the translator's continuous batcher -> an n-best list of
completions per text, or a stream (greedy, one text).

`source_ids` is how the translator reads a text, here and in scoring (`service.serving.score`): every token of it,
or a 400 naming the field and the model's `max_source_length` when it has more; a source is never cut.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from service.decoding import BeamSearch, GreedySearch, Search
from service.errors import BadInput
from service.models.registry import LoadedModel
from service.scheduling.jobs import TextJob
from service.serving.awaiting import run_text_jobs
from service.serving.context import Caller, check_new_tokens
from service.serving.outputs import Completion, completion_from
from service.serving.streaming import (
    Finished,
    IncrementalText,
    Piece,
    stream_jobs,
)


@dataclass(frozen=True)
class TranslationParams:
    num_beams: int = 4
    length_penalty: float | None = None  # None: the model's (its config.json `generation`, chosen on validation)
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    max_new_tokens: int | None = None  # default: twice the source length + 10, within the model's maximum
    min_new_tokens: int = 0
    no_repeat_ngram_size: int = 0

    @property
    def mode(self) -> str:
        return "beam" if self.num_beams > 1 else "greedy"


def source_ids(loaded: LoadedModel, texts: Sequence[str], field: str) -> list[list[int]]:
    """The texts as the translator reads them (tabs and newlines as spaces, the end-of-source token last), on a
    worker thread; BadInput naming `field` (and the text's index) when one has more tokens than the model reads."""
    engine, sources = loaded.engine, []
    for index, text in enumerate(texts):
        ids = engine.source_ids(" ".join(text.split()))
        if len(ids) > engine.max_source_length:
            raise BadInput(f"{field} {index} has {len(ids)} tokens (its end-of-source token included); model "
                           f"{loaded.name} version {loaded.version} reads at most {engine.max_source_length} "
                           f"(max_source_length): shorten or split it", param=field)
        sources.append(ids)
    return sources


def _jobs(loaded: LoadedModel, texts: Sequence[str], params: TranslationParams, deadline: float) -> list[TextJob]:
    """One job per text; the texts are tokenized here, so call it on a worker thread."""
    if params.num_return_sequences > params.num_beams:
        raise BadInput(f"num_return_sequences ({params.num_return_sequences}) must be <= num_beams "
                       f"({params.num_beams})")
    check_new_tokens(params.min_new_tokens, params.max_new_tokens)
    engine = loaded.engine
    jobs = []
    for source in source_ids(loaded, texts, "text"):
        max_new = min(params.max_new_tokens or engine.default_max_new_tokens(len(source)),
                      engine.max_target_length - 1)
        search: Search
        if params.num_beams == 1:
            search = GreedySearch(max_new, engine.eos_id, min_new_tokens=params.min_new_tokens,
                                  no_repeat_ngram_size=params.no_repeat_ngram_size, prefix=[engine.bos_id])
        else:
            length_penalty = engine.length_penalty if params.length_penalty is None else params.length_penalty
            search = BeamSearch(params.num_beams, max_new, engine.eos_id, length_penalty=length_penalty,
                                early_stopping=params.early_stopping,
                                num_return_sequences=params.num_return_sequences,
                                no_repeat_ngram_size=params.no_repeat_ngram_size,
                                min_new_tokens=params.min_new_tokens, prefix=[engine.bos_id])
        jobs.append(TextJob(source, search, params.mode, deadline))
    return jobs


async def translate(request: Caller, loaded: LoadedModel, texts: Sequence[str], params: TranslationParams,
                    deadline: float) -> list[list[Completion]]:
    """An n-best list (`num_return_sequences` long, best first) per text."""
    jobs = await run_in_threadpool(_jobs, loaded, texts, params, deadline)
    results = await run_text_jobs(request, loaded, jobs, deadline)
    decode = loaded.engine.tokenizer.decode
    return [[completion_from(h, decode, (), len(job.input_ids)) for h in hypotheses[: params.num_return_sequences]]
            for job, hypotheses in zip(jobs, results)]


async def stream(loaded: LoadedModel, text: str, params: TranslationParams,
                 deadline: float) -> AsyncIterator[list[Piece | Finished]]:
    """Stream the greedy translation of one text (choice 0). Submitted now."""
    if params.num_beams != 1:
        raise BadInput("stream=true needs num_beams=1 and a single text")
    jobs = await run_in_threadpool(_jobs, loaded, [text], params, deadline)
    tokenizer = loaded.engine.tokenizer

    def complete(choice: int, hypothesis) -> Completion:
        return completion_from(hypothesis, tokenizer.decode, (), len(jobs[choice].input_ids))

    return stream_jobs(loaded, jobs, [IncrementalText(tokenizer)], complete)
