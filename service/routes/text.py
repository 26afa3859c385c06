"""`POST /v1/translate` and `POST /v1/generate`: validate -> build the search -> submit to the model's
continuous batcher -> await the result (or stream it as server-sent events) -> response.

The route never runs the model: the scheduler's worker thread does. While a request waits, its client is
watched: a disconnect cancels it and its rows are freed at the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from service.decoding import BeamSearch, GreedySearch, Hypothesis, SamplingSearch, StopStrings, truncate_at_stop
from service.errors import BadInput, Cancelled, DeadlineExceeded, PayloadTooLarge, ServiceError
from service.handoff import mailbox_for
from service.protocol import (ErrorResponse, GenerateRequest, GenerateResponse, TranslateRequest, TranslateResponse,
                              Translation, Usage)
from service.registry import LoadedModel
from service.scheduling.continuous import TextJob

router = APIRouter(tags=["text"])

ERRORS = {status: {"model": ErrorResponse, "description": text} for status, text in {
    400: "Bad input (e.g. prompt too long for the model's context)", 404: "Unknown model or version",
    413: "Text too long or too many texts", 422: "Invalid or out-of-range field, or unknown field",
    429: "Queue full; retry after the Retry-After header's seconds", 503: "Not ready or draining",
    504: "The request's deadline expired"}.items()}
STREAM_DOC = {200: {"content": {"text/event-stream": {"example": 'data: {"token": " A", "index": 0}\n\n'
                                                       'data: {"token": "", "index": 1, "finish_reason": "eos", '
                                                       '"usage": {...}}\n\ndata: [DONE]\n\n'}},
                    "description": "JSON, or with stream=true server-sent events: one per token, then a final event "
                                   "with finish_reason and usage, then [DONE]. Concatenating the events' `token` "
                                   "fields gives the full text."}}


def _deadline(request: Request, timeout_ms: int | None) -> float:
    settings = request.app.state.settings
    if timeout_ms is not None and timeout_ms > settings.max_timeout_ms:
        raise BadInput(f"timeout_ms={timeout_ms} exceeds the maximum of {settings.max_timeout_ms}")
    return time.monotonic() + (timeout_ms or settings.default_timeout_ms) / 1000.0


def _label(request: Request, loaded: LoadedModel, mode: str) -> None:
    request.state.model, request.state.version, request.state.mode = loaded.name, loaded.version, mode


def _check_limits(request: Request, max_new_tokens: int | None, num_beams: int) -> None:
    settings = request.app.state.settings
    if max_new_tokens is not None and max_new_tokens > settings.max_new_tokens:
        raise BadInput(f"max_new_tokens={max_new_tokens} exceeds the server limit of {settings.max_new_tokens}")
    if num_beams > settings.max_num_beams:
        raise BadInput(f"num_beams={num_beams} exceeds the server limit of {settings.max_num_beams}")


def _submit(loaded: LoadedModel, jobs: list[TextJob]) -> None:
    try:
        for job in jobs:
            loaded.scheduler.submit(job)
    except ServiceError:
        for job in jobs:
            job.cancel()
        raise


async def _wait(request: Request, jobs: list[TextJob], deadline: float) -> list[list[Hypothesis]]:
    """Await every job; cancel them all if the client disconnects, the deadline passes or one fails."""
    gathered = asyncio.gather(*(asyncio.wrap_future(job.future) for job in jobs))
    try:
        while True:
            done, _ = await asyncio.wait({gathered}, timeout=0.2)
            if done:
                return gathered.result()
            if await request.is_disconnected():
                raise Cancelled("client went away")
            if time.monotonic() > deadline + 1.0:  # the scheduler enforces the deadline; this is the backstop
                raise DeadlineExceeded("the request's deadline expired")
    except BaseException:
        for job in jobs:
            job.cancel()
        gathered.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no asyncio error log
        gathered.cancel()
        raise


class _IncrementalText:
    """Token ids -> text pieces whose concatenation is the final text: a piece is released only once it can no
    longer change (no half UTF-8 character at the end, no possible start of a stop string)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode = decode
        self.stops = stops
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.released = 0

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text, hit = truncate_at_stop(self.decode(self.ids), self.stops)
        stable = len(text) if hit else len(text) - self.holdback
        if text.endswith("\ufffd"):
            stable = min(stable, len(text) - 1)
        piece = text[self.released : max(self.released, stable)]
        self.released += len(piece)
        return piece

    def finish(self, final_text: str) -> str:
        return final_text[self.released :]


def _sse(payload) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def _stream(request: Request, loaded: LoadedModel, job: TextJob, decode: Callable[[list[int]], str],
            finish: Callable[[Hypothesis], tuple[str, dict]], stops: list[str]) -> StreamingResponse:
    """Submit `job` and stream its tokens. `finish(hypothesis)` -> (final text, extra fields of the last event)."""
    mailbox = mailbox_for(asyncio.get_running_loop())  # one loop wake-up per decoding step, not per stream
    updates: asyncio.Queue = asyncio.Queue()
    job.on_tokens = lambda ids: mailbox.put(updates, ids)
    job.future.add_done_callback(lambda _: mailbox.put(updates, None))
    _submit(loaded, [job])  # before the response starts, so a full queue is still a 429

    async def events() -> AsyncIterator[bytes]:
        text = _IncrementalText(decode, stops)
        index = 0
        try:
            finished = False
            while not finished:
                # whatever arrived since the last write goes out as one chunk (several events) in one send
                arrived = [await updates.get()]
                while not updates.empty():
                    arrived.append(updates.get_nowait())
                events_now = []
                for ids in arrived:
                    if ids is None:  # the job is done; nothing follows it in the queue
                        finished = True
                        break
                    for token in ids:
                        events_now.append(_sse({"token": text.add([token]), "index": index}))
                        index += 1
                if events_now:
                    yield b"".join(events_now)
            try:
                hypothesis = job.future.result()[0]
            except ServiceError as error:  # the status (200) is already sent: count the failure here
                request.app.state.metrics.failures.labels(model=loaded.name, version=str(loaded.version),
                                                          reason=error.reason).inc()
                yield _sse({"error": {"type": error.type, "message": error.message}})
            else:
                final_text, extra = finish(hypothesis)
                yield _sse({"token": text.finish(final_text), "index": index, **extra})
            yield _sse("[DONE]")
        finally:
            job.cancel()  # no-op when finished; frees the rows when the client went away mid-stream

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.post("/v1/translate", response_model=TranslateResponse, responses={**ERRORS, **STREAM_DOC},
             summary="Translate German to English (beam search, greedy, or streamed greedy)")
async def translate(body: TranslateRequest, request: Request):
    settings = request.app.state.settings
    loaded = request.app.state.registry.resolve("translation", body.model, body.version)
    mode = "beam" if body.num_beams > 1 else "greedy"
    _label(request, loaded, mode)
    texts = [body.text] if isinstance(body.text, str) else body.text
    if not texts:
        raise BadInput("text: give at least one sentence")
    if len(texts) > settings.max_texts:
        raise PayloadTooLarge(f"text: {len(texts)} sentences; at most {settings.max_texts} per request")
    for i, text in enumerate(texts):
        if not text.strip():
            raise BadInput(f"text[{i}] is empty")
        if len(text) > settings.max_text_chars:
            raise PayloadTooLarge(f"text[{i}] has {len(text)} characters; the limit is {settings.max_text_chars}")
    _check_limits(request, body.max_new_tokens, body.num_beams)
    deadline = _deadline(request, body.timeout_ms)
    engine = loaded.engine
    sources = [engine.source_ids(" ".join(text.split())) for text in texts]  # tabs/newlines -> spaces

    def search_for(source: list[int]):
        max_new = min(body.max_new_tokens or engine.default_max_new_tokens(len(source)), engine.max_target_length - 1)
        if body.num_beams == 1:
            return GreedySearch(max_new, engine.eos_id, min_new_tokens=body.min_new_tokens)
        return BeamSearch(body.num_beams, max_new, engine.eos_id, length_penalty=body.length_penalty,
                          early_stopping=body.early_stopping, num_return_sequences=body.num_return_sequences,
                          no_repeat_ngram_size=body.no_repeat_ngram_size, min_new_tokens=body.min_new_tokens,
                          prefix=[engine.bos_id])

    jobs = [TextJob(source, search_for(source), mode, deadline) for source in sources]
    decode = engine.tokenizer.decode
    if body.stream:
        return _stream(request, loaded, jobs[0], decode,
                       lambda h: (decode(h.tokens), {"finish_reason": h.finish_reason, "score": h.score}), [])
    _submit(loaded, jobs)
    results = await _wait(request, jobs, deadline)
    return TranslateResponse(model=loaded.name, version=loaded.version, translations=[
        [Translation(text=decode(h.tokens), score=h.score) for h in hypotheses[: body.num_return_sequences]]
        for hypotheses in results])


@router.post("/v1/generate", response_model=GenerateResponse, responses={**ERRORS, **STREAM_DOC},
             summary="Continue a prompt (sampling, greedy with temperature 0, or beam search)")
async def generate(body: GenerateRequest, request: Request):
    settings = request.app.state.settings
    loaded = request.app.state.registry.resolve("gpt", body.model, body.version)
    _label(request, loaded, body.mode)
    if len(body.prompt) > settings.max_text_chars:
        raise PayloadTooLarge(f"prompt has {len(body.prompt)} characters; the limit is {settings.max_text_chars}")
    _check_limits(request, body.max_new_tokens, body.num_beams)
    deadline = _deadline(request, body.timeout_ms)
    engine = loaded.engine
    prompt = engine.tokenizer.encode(body.prompt).ids
    if len(prompt) + body.max_new_tokens > engine.context_length:
        raise BadInput(f"prompt ({len(prompt)} tokens) + max_new_tokens ({body.max_new_tokens}) exceeds the "
                       f"model's context of {engine.context_length} tokens")
    decode = engine.tokenizer.decode
    stop_checker = StopStrings(body.stop, decode) if body.stop else None
    if body.num_beams > 1:
        search = BeamSearch(body.num_beams, body.max_new_tokens, engine.eos_id, prefix=prompt,
                            min_new_tokens=body.min_new_tokens)
    else:  # temperature 0 = greedy (after the repetition penalty), else sampling
        search = SamplingSearch(body.max_new_tokens, engine.eos_id, temperature=body.temperature, top_k=body.top_k,
                                top_p=body.top_p, repetition_penalty=body.repetition_penalty, seed=body.seed,
                                min_new_tokens=body.min_new_tokens, prefix=prompt, stop_checker=stop_checker)
    job = TextJob(prompt, search, body.mode, deadline)

    def finish(hypothesis: Hypothesis) -> tuple[str, dict]:
        text, hit = truncate_at_stop(decode(hypothesis.tokens), body.stop)
        reason = "stop" if hit else hypothesis.finish_reason
        usage = Usage(prompt_tokens=len(prompt), completion_tokens=len(hypothesis.tokens))
        return text, {"finish_reason": reason, "usage": usage.model_dump()}

    if body.stream:
        return _stream(request, loaded, job, decode, finish, body.stop)
    _submit(loaded, [job])
    hypothesis = (await _wait(request, [job], deadline))[0][0]
    text, extra = finish(hypothesis)
    return GenerateResponse(model=loaded.name, version=loaded.version, text=text, **extra)
