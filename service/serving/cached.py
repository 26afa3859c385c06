"""The response cache in the serving layer (`service.response_cache`, docs/response_cache.md), so that every API gets
it from one place: a capability names its key's fields and its answer's classes, and `answer` looks the request up
before anything is submitted (a hit never reaches a scheduler), computes the answer on a miss and stores it.

Streams (`answer_stream`): a hit is replayed as a stream, each choice's whole text in one piece and then its end;
a stream that ran to its end stores its completions, which are what the same request unstreamed returns (one key
for both). A request whose answer is not a function of its key (`cacheable=False`: sampling without a seed) is
neither looked up nor stored; a cache that fails (Redis down) makes a miss, never an error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from service.decoding import TokenLogprob
from service.models.registry import LoadedModel
from service.scheduling.jobs import PromptLogprobs
from service.serving.outputs import Completion
from service.serving.streaming import Finished, Piece

T = TypeVar("T")
Events = AsyncIterator[list[Piece | Finished]]
# the classes of a text answer (a list of `Completion` lists), which an entry is rebuilt from
COMPLETION_TYPES = (Completion, TokenLogprob, PromptLogprobs)
# the capabilities, one key space each
TRANSLATE, GENERATE, SCORE, CLASSIFY, PIXELS = "translate", "generate", "score", "classify", "pixels"


def _on(loaded: LoadedModel, cacheable: bool):
    """The version's cache when this request may use it, else None (an uncacheable request counted)."""
    cache = loaded.response_cache
    if cache is None or not cache.enabled:
        return None
    if not cacheable:
        cache.uncacheable()
        return None
    return cache


async def answer(loaded: LoadedModel, capability: str, fields: Mapping[str, Any], compute: Callable[[], Awaitable[T]],
                 types: Iterable[type] = (), blobs: Sequence[bytes] = (), cacheable: bool = True) -> T:
    """The answer to a request of `capability` whose parameters and inputs are `fields` (binary ones `blobs`): from
    the cache, or `compute()`d and stored (see the module docstring)."""
    cache = _on(loaded, cacheable)
    if cache is None:
        return await compute()
    key = cache.key(capability, fields, blobs)
    found = await cache.lookup(key, types)
    if found is not None:
        return found
    result = await compute()
    await cache.save(key, result)
    return result


async def answer_stream(loaded: LoadedModel, capability: str, fields: Mapping[str, Any],
                        start: Callable[[], Awaitable[Events]], inputs: int, choices: int,
                        cacheable: bool = True) -> Events:
    """The events of a streamed request whose unstreamed answer is `choices` completions for each of `inputs`
    (choice `p * choices + i` is input p's i-th): a hit replayed, or `start()`'s events (submitted by it, now),
    recorded to be stored."""
    cache = _on(loaded, cacheable)
    if cache is None:
        return await start()
    key = cache.key(capability, fields)
    found = await cache.lookup(key, COMPLETION_TYPES)
    if found is not None:
        return _replay([completion for group in found for completion in group])
    return _recording(await start(), cache, key, inputs, choices)


async def _replay(completions: list[Completion]) -> Events:
    events: list[Piece | Finished] = []
    for choice, completion in enumerate(completions):
        if completion.token_ids or completion.text:
            events.append(Piece(choice, completion.text, list(completion.token_ids), completion.logprobs))
        events.append(Finished(choice, completion))
    yield events


async def _recording(events: Events, cache, key: str, inputs: int, choices: int) -> Events:
    """`events`, passed on; once every choice has finished with a completion, they are stored before the batch
    that finished the last one is passed on (a consumer may stop at its final event)."""
    finished: dict[int, Completion] = {}
    try:
        async for batch in events:
            done = len(finished)
            finished.update((e.choice, e.completion) for e in batch
                            if isinstance(e, Finished) and e.completion is not None)
            if done < len(finished) == inputs * choices:
                await cache.save(key, [[finished[p * choices + i] for i in range(choices)] for p in range(inputs)])
            yield batch
    finally:
        await events.aclose()
