"""German -> English translation, for every API: protocol-neutral parameters -> one search per text (the texts
tokenized on a worker thread, not the event loop) -> the translator's continuous batcher -> an n-best list of
completions per text, or a stream (greedy, one text).

`source_ids` is how the translator reads a text, here and in scoring (`service.serving.score`): every token of it,
or a 400 naming the field and the model's `max_source_length` when it has more; a source is never cut.
`prefix_ids` is how it reads a `target_prefix` (CTranslate2's option), which every search emits first
(`service.decoding.forced_prefix`): the text returned and streamed begins with it, the score leaves it out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from service.decoding import BeamSearch, GreedySearch, Search
from service.errors import BadInput
from service.models.registry import LoadedModel
from service.scheduling.jobs import TextJob
from service.serving.awaiting import run_text_jobs
from service.serving.cached import COMPLETION_TYPES, TRANSLATE, answer, answer_stream
from service.serving.context import Caller, check_new_tokens, priority_level
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
    target_prefix: str | None = None  # the text every translation starts with (`prefix_ids`); None or "": none
    priority: int | None = None  # its queue level (`service.scheduling.priority`); None: the model's default

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


def prefix_ids(loaded: LoadedModel, text: str | None, field: str = "target_prefix") -> list[int]:
    """A target prefix as the translator writes it: whitespace runs as one space, none at either end, tokenized on
    its own (so its last word is split as a whole word; no start token, no EOS); [] when blank. BadInput naming
    `field` when the vocabulary cannot write it (it would not read back as itself) or it leaves no room in the
    model's target length for a token after it."""
    engine = loaded.engine
    text = " ".join((text or "").split())
    if not text:
        return []
    ids = engine.tokenizer.encode(text).ids
    normalizer = engine.tokenizer.normalizer  # e.g. NFKC: the text as the tokenizer writes it
    written = engine.tokenizer.decode(ids)
    if written != (normalizer.normalize_str(text) if normalizer else text):
        raise BadInput(f"{field} reads back as {written!r}: model {loaded.name} version {loaded.version}'s "
                       f"vocabulary cannot write some of its characters", param=field)
    room = engine.max_target_length - 2  # the start token first, one generated token at least after the prefix
    if len(ids) > room:
        raise BadInput(f"{field} has {len(ids)} tokens; model {loaded.name} version {loaded.version} writes at "
                       f"most {room} before the token it must generate (max_target_length "
                       f"{engine.max_target_length}, its start token included)", param=field)
    return ids


def _with_prefix(loaded: LoadedModel, forced: Sequence[int]) -> Callable[[list[int]], str]:
    """Generated tokens -> the translation's text, the forced prefix's in front (decoded together, so that the
    first generated word is spaced as the model wrote it)."""
    decode = loaded.engine.tokenizer.decode
    return (lambda ids: decode([*forced, *ids])) if forced else decode


def _jobs(loaded: LoadedModel, texts: Sequence[str], params: TranslationParams, deadline: float
          ) -> tuple[list[TextJob], list[int]]:
    """One job per text, and the target prefix's tokens; the texts are tokenized here, so call it on a worker
    thread."""
    if params.num_return_sequences > params.num_beams:
        raise BadInput(f"num_return_sequences ({params.num_return_sequences}) must be <= num_beams "
                       f"({params.num_beams})")
    check_new_tokens(params.min_new_tokens, params.max_new_tokens)
    engine = loaded.engine
    forced = prefix_ids(loaded, params.target_prefix)
    priority = priority_level(loaded, params.priority)
    jobs = []
    for source in source_ids(loaded, texts, "text"):
        # max_new_tokens counts the tokens after the prefix (transformers' decoder_input_ids); all in the table
        max_new = min(params.max_new_tokens or engine.default_max_new_tokens(len(source)),
                      engine.max_target_length - 1 - len(forced))
        search: Search
        if params.num_beams == 1:
            search = GreedySearch(max_new, engine.eos_id, min_new_tokens=params.min_new_tokens,
                                  no_repeat_ngram_size=params.no_repeat_ngram_size, prefix=[engine.bos_id],
                                  forced_prefix=forced)
        else:
            length_penalty = engine.length_penalty if params.length_penalty is None else params.length_penalty
            search = BeamSearch(params.num_beams, max_new, engine.eos_id, length_penalty=length_penalty,
                                early_stopping=params.early_stopping,
                                num_return_sequences=params.num_return_sequences,
                                no_repeat_ngram_size=params.no_repeat_ngram_size,
                                min_new_tokens=params.min_new_tokens, prefix=[engine.bos_id],
                                forced_prefix=forced)
        jobs.append(TextJob(source, search, params.mode, deadline, priority=priority))
    return jobs, forced


async def translate(request: Caller, loaded: LoadedModel, texts: Sequence[str], params: TranslationParams,
                    deadline: float) -> list[list[Completion]]:
    """An n-best list (`num_return_sequences` long, best first) per text; a repeat from the response cache where it
    is on (`service.serving.cached`)."""
    priority_level(loaded, params.priority)  # a level out of range is a 400, cached answer or not
    return await answer(loaded, TRANSLATE, {"texts": texts, "params": params},
                        lambda: _translate(request, loaded, texts, params, deadline), COMPLETION_TYPES)


async def _translate(request: Caller, loaded: LoadedModel, texts: Sequence[str], params: TranslationParams,
                     deadline: float) -> list[list[Completion]]:
    jobs, forced = await run_in_threadpool(_jobs, loaded, texts, params, deadline)
    results = await run_text_jobs(request, loaded, jobs, deadline)
    decode = _with_prefix(loaded, forced)
    return [[completion_from(h, decode, (), len(job.input_ids)) for h in hypotheses[: params.num_return_sequences]]
            for job, hypotheses in zip(jobs, results)]


async def stream(loaded: LoadedModel, text: str, params: TranslationParams,
                 deadline: float) -> AsyncIterator[list[Piece | Finished]]:
    """Stream the greedy translation of one text (choice 0), its target prefix first (one piece, before the first
    step). Submitted now, or replayed from the response cache (`service.serving.cached`)."""
    if params.num_beams != 1:
        raise BadInput("stream=true needs num_beams=1 and a single text")
    priority_level(loaded, params.priority)
    return await answer_stream(loaded, TRANSLATE, {"texts": [text], "params": params},
                               lambda: _stream(loaded, text, params, deadline), 1, 1)


async def _stream(loaded: LoadedModel, text: str, params: TranslationParams,
                  deadline: float) -> AsyncIterator[list[Piece | Finished]]:
    jobs, forced = await run_in_threadpool(_jobs, loaded, [text], params, deadline)
    decode, pieces = _with_prefix(loaded, forced), IncrementalText(loaded.engine.tokenizer)

    def complete(choice: int, hypothesis) -> Completion:
        return completion_from(hypothesis, decode, (), len(jobs[choice].input_ids))

    events = stream_jobs(loaded, jobs, [pieces], complete)
    return _first(Piece(0, pieces.add(forced), list(forced)), events) if forced else events


async def _first(piece: Piece, events: AsyncIterator[list[Piece | Finished]]
                 ) -> AsyncIterator[list[Piece | Finished]]:
    """`piece`, then `events`; leaving early closes `events` (which cancels its jobs)."""
    try:
        yield [piece]
        async for batch in events:
            yield batch
    finally:
        await events.aclose()
