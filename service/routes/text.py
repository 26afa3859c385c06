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
from service.errors import BadInput, ServiceError
from service.handoff import mailbox_for
from service.protocol import ErrorResponse, GenerateResponse, RequestModels, TranslateResponse, Translation, Usage
from service.registry import LoadedModel
from service.routes import with_body
from service.routes.awaiting import await_results
from service.scheduling.continuous import TextJob

ERRORS = {status: {"model": ErrorResponse, "description": text} for status, text in {
    400: "A request the schema allows but this model cannot serve, with the reason: the prompt's tokens plus "
         "max_new_tokens exceed the model's context, num_return_sequences above num_beams, stream with beams or "
         "several texts",
    404: "Unknown model or version, or a model of another kind",
    408: "The body did not arrive within TSERVE_BODY_TIMEOUT_S", 413: "Body over TSERVE_MAX_BODY_BYTES",
    422: "The request does not conform to the schema: a field missing, unknown, of the wrong type or out of its "
         "range (the limits are in the schema); the message names the field",
    429: "Queue full; retry after the Retry-After header's seconds", 503: "Not ready or draining",
    504: "The request's deadline expired"}.items()}
STREAM_DOC = {200: {"content": {"text/event-stream": {"example": 'data: {"token": " A", "index": 0}\n\n'
                                                       'data: {"token": "", "index": 1, "finish_reason": "eos", '
                                                       '"usage": {...}}\n\ndata: [DONE]\n\n'}},
                    "description": "JSON, or with stream=true server-sent events: one per token, then a final event "
                                   "with finish_reason and usage, then [DONE]. Concatenating the events' `token` "
                                   "fields gives the full text."}}


def build_router(models: RequestModels) -> APIRouter:
    """The text routes, validating bodies with this app's request models."""
    router = APIRouter(tags=["text"])
    router.add_api_route("/v1/translate", with_body(translate, models.translate), methods=["POST"],
                         response_model=TranslateResponse, responses={**ERRORS, **STREAM_DOC},
                         summary="Translate German to English (beam search, greedy, or streamed greedy)")
    router.add_api_route("/v1/generate", with_body(generate, models.generate), methods=["POST"],
                         response_model=GenerateResponse, responses={**ERRORS, **STREAM_DOC},
                         summary="Continue a prompt (sampling, greedy with temperature 0, or beam search)")
    return router


def _deadline(request: Request, timeout_ms: int | None) -> float:
    return time.monotonic() + (timeout_ms or request.app.state.settings.default_timeout_ms) / 1000.0


def _label(request: Request, loaded: LoadedModel, mode: str) -> None:
    request.state.model, request.state.version, request.state.mode = loaded.name, loaded.version, mode


def _submit(loaded: LoadedModel, jobs: list[TextJob]) -> None:
    try:
        for job in jobs:
            loaded.scheduler.submit(job)
    except ServiceError:
        for job in jobs:
            job.cancel()
        raise


async def _wait(request: Request, jobs: list[TextJob], deadline: float) -> list[list[Hypothesis]]:
    """Every job's hypotheses; all jobs are cancelled if the client disconnects, the deadline passes or one fails."""
    return await await_results(request, [job.future for job in jobs], deadline,
                               abandon=lambda: [job.cancel() for job in jobs])


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
        index, finished, delivered = 0, False, False
        try:
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
            except ServiceError as error:  # the status (200) is already sent: the middleware counts this reason
                request.state.failure_reason = error.reason
                yield _sse({"error": {"type": error.type, "message": error.message}})
            else:
                final_text, extra = finish(hypothesis)
                yield _sse({"token": text.finish(final_text), "index": index, **extra})
            yield _sse("[DONE]")
            delivered = True
        finally:
            if not delivered and not getattr(request.state, "failure_reason", None):  # the client went away
                request.state.failure_reason = "cancelled"
            job.cancel()  # no-op when finished; frees the rows when the client went away mid-stream

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def translate(body, request: Request):
    """German -> English for one text or a list of texts; beam search, greedy, or streamed greedy."""
    loaded = request.app.state.registry.resolve("translation", body.model, body.version)
    mode = "beam" if body.num_beams > 1 else "greedy"
    _label(request, loaded, mode)
    texts = [body.text] if isinstance(body.text, str) else body.text
    if body.num_return_sequences > body.num_beams:
        raise BadInput(f"num_return_sequences ({body.num_return_sequences}) must be <= num_beams ({body.num_beams})")
    if body.stream and (body.num_beams != 1 or not isinstance(body.text, str)):
        raise BadInput("stream=true needs num_beams=1 and a single text")
    deadline = _deadline(request, body.timeout_ms)
    engine = loaded.engine
    sources = [engine.source_ids(" ".join(text.split())) for text in texts]  # tabs/newlines -> spaces

    def search_for(source: list[int]):
        max_new = min(body.max_new_tokens or engine.default_max_new_tokens(len(source)), engine.max_target_length - 1)
        if body.num_beams == 1:
            return GreedySearch(max_new, engine.eos_id, min_new_tokens=body.min_new_tokens,
                                no_repeat_ngram_size=body.no_repeat_ngram_size, prefix=[engine.bos_id])
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


async def generate(body, request: Request):
    """Continue a prompt: sampling, greedy (temperature 0) or beam search; optionally streamed."""
    loaded = request.app.state.registry.resolve("gpt", body.model, body.version)
    _label(request, loaded, body.mode)
    if body.stream and body.num_beams > 1:
        raise BadInput("stream=true needs num_beams=1")
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
                            min_new_tokens=body.min_new_tokens, no_repeat_ngram_size=body.no_repeat_ngram_size)
    else:  # temperature 0 = greedy (after the repetition penalty), else sampling
        search = SamplingSearch(body.max_new_tokens, engine.eos_id, temperature=body.temperature, top_k=body.top_k,
                                top_p=body.top_p, repetition_penalty=body.repetition_penalty, seed=body.seed,
                                min_new_tokens=body.min_new_tokens, prefix=prompt, stop_checker=stop_checker,
                                no_repeat_ngram_size=body.no_repeat_ngram_size)
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
