"""`POST /v1/translate`, `POST /v1/translate/score` and `POST /v1/generate`, the native JSON API: a thin adapter
from this API's request to the serving layer (`service.serving.translate` / `.score` / `.generate`) and from its
results back to this API's response or server-sent events. Validation and the mapping to the serving parameters
(`to_params`) are the request model's (`service.api.native.protocol`); decoding, streaming, deadlines and
cancellation are the serving layer's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from service.errors import BadInput
from service.api.native.protocol import (
    ErrorResponse,
    GenerateResponse,
    RequestModels,
    ScoreResponse,
    TargetScore,
    TranslateResponse,
    Translation,
    Usage,
)
from service.client.sse import event as sse_event
from service.http.apis import NATIVE
from service.http.routing import NOT_JSON_DESCRIPTION, NOT_JSON_STATUS, sse_response, with_body
from service.repository import GPT, TRANSLATION
from service.observability.metrics import SCORE
from service.serving import generate as generation
from service.serving import score as scoring
from service.serving import translate as translation
from service.serving.constrain import compile_constraint
from service.serving.context import deadline_of, label, resolve
from service.serving.outputs import Completion
from service.serving.streaming import Finished, Piece

ERRORS = {status: {"model": ErrorResponse, "description": text} for status, text in {
    400: "A request the schema allows but this model cannot serve, with the reason: the prompt's tokens plus "
         "max_new_tokens exceed the model's context, num_return_sequences above num_beams, stream with beams or "
         "several texts, a target_prefix the vocabulary cannot write or too long for the model",
    404: "Unknown model or version, or a model of another kind",
    408: "The body did not arrive within TSERVE_BODY_TIMEOUT_S", 413: "Body over TSERVE_MAX_BODY_BYTES",
    422: "The request does not conform to the schema: a field missing, unknown, of the wrong type or out of its "
         "range (the limits are in the schema); the message names the field",
    429: "Queue full; retry after the Retry-After header's seconds", 503: "Not ready or draining",
    504: "The request's deadline expired", NOT_JSON_STATUS: NOT_JSON_DESCRIPTION}.items()}
STREAM_DOC = {200: {"content": {"text/event-stream": {"example": 'data: {"token": " A", "index": 0}\n\n'
                                                       'data: {"token": "", "index": 1, "finish_reason": "eos", '
                                                       '"usage": {...}}\n\ndata: [DONE]\n\n'}},
                    "description": "JSON, or with stream=true server-sent events: one per token, then a final event "
                                   "with finish_reason and usage, then [DONE]. Concatenating the events' `token` "
                                   "fields gives the full text."}}

SCORE_400 = {400: {"model": ErrorResponse, "description": "Targets that do not pair with the sources (a list of "
                   "sources needs as many targets), or a target longer than the model's positional table"}}


def build_router(models: RequestModels) -> APIRouter:
    """The text routes, validating bodies with this app's request models."""
    router = APIRouter(tags=["text"], route_class=NATIVE.route_class)
    router.add_api_route("/v1/translate", with_body(translate, models.translate), methods=["POST"],
                         response_model=TranslateResponse, responses={**ERRORS, **STREAM_DOC},
                         summary="Translate German to English (beam search, greedy, or streamed greedy)")
    router.add_api_route("/v1/translate/score", with_body(score, models.score), methods=["POST"],
                         response_model=ScoreResponse, responses={**ERRORS, **SCORE_400},
                         summary="Score given English translations of German sources (forced decoding: each "
                                 "token's log-probability)")
    router.add_api_route("/v1/generate", with_body(generate, models.generate), methods=["POST"],
                         response_model=GenerateResponse, responses={**ERRORS, **STREAM_DOC},
                         summary="Continue a prompt (sampling, greedy with temperature 0, or beam search)")
    return router


def _native_stream(request: Request, events: AsyncIterator[list[Piece | Finished]],
                   final: Callable[[Completion], dict]) -> StreamingResponse:
    """This API's stream of one choice: `{"token", "index"}` per piece, a final event with `final(completion)`'s
    fields (or `{"error"}`), then [DONE]. Whatever arrived since the last write goes out as one chunk."""

    async def chunks() -> AsyncIterator[bytes]:
        index = 0
        async for batch in events:
            chunk = []
            for event in batch:
                if isinstance(event, Piece):
                    chunk.append(sse_event({"token": event.text, "index": index}))
                    index += 1
                elif event.error is not None:  # the status (200) is already sent: the middleware counts this
                    request.state.failure_reason = event.error.reason
                    chunk.append(sse_event({"error": {"type": event.error.type, "message": event.error.message}}))
                else:
                    chunk.append(sse_event({"token": event.rest, "index": index, **final(event.completion)}))
            if chunk:
                yield b"".join(chunk)

    return sse_response(request, chunks(), events)


async def translate(body, request: Request):
    """German -> English for one text or a list of texts; beam search, greedy, or streamed greedy."""
    loaded = resolve(request, TRANSLATION, body.model, body.version)
    params = body.to_params()
    label(request, loaded, params.mode)
    deadline = deadline_of(request, body.timeout_ms)
    if body.stream:
        if not isinstance(body.text, str):
            raise BadInput("stream=true needs num_beams=1 and a single text")
        return _native_stream(request, await translation.stream(loaded, body.text, params, deadline),
                              lambda c: {"finish_reason": c.finish_reason, "score": c.score})
    texts = [body.text] if isinstance(body.text, str) else body.text
    results = await translation.translate(request, loaded, texts, params, deadline)
    return TranslateResponse(model=loaded.name, version=loaded.version, translations=[
        [Translation(text=c.text, score=c.score) for c in completions] for completions in results])


async def score(body, request: Request):
    """The log-probability of each target given its source under the translator, token by token (CTranslate2's
    `score_batch`): for reranking or scoring translations."""
    loaded = resolve(request, TRANSLATION, body.model, body.version)
    label(request, loaded, SCORE)
    deadline = deadline_of(request, body.timeout_ms)
    scored = await scoring.score(request, loaded, scoring.pairs_of(body.source, body.target), deadline)
    return ScoreResponse(model=loaded.name, version=loaded.version, scores=[
        TargetScore(tokens=t.tokens, token_ids=t.token_ids, logprobs=t.logprobs, score=t.score,
                    mean_logprob=t.mean_logprob) for t in scored.targets],
        usage=Usage(prompt_tokens=scored.source_tokens, completion_tokens=scored.target_tokens))


async def generate(body, request: Request):
    """Continue a prompt: sampling, greedy (temperature 0) or beam search; optionally streamed."""
    loaded = resolve(request, GPT, body.model, body.version)
    params = body.to_params()
    label(request, loaded, params.mode)
    deadline = deadline_of(request, body.timeout_ms)
    (prompt,) = await generation.encode_prompts(loaded, [body.prompt], body.max_new_tokens)

    def final(c: Completion) -> dict:
        usage = Usage(prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens)
        return {"finish_reason": c.finish_reason, "usage": usage.model_dump()}

    if body.stream:  # a constraint compiled first: one that does not compile is a 400, not an error event
        params = await compile_constraint(loaded, params)
        return _native_stream(request, await generation.stream(loaded, [prompt], params, deadline), final)
    completion = (await generation.generate(request, loaded, [prompt], params, deadline))[0][0]
    return GenerateResponse(model=loaded.name, version=loaded.version, text=completion.text, **final(completion))
