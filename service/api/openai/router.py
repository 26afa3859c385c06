"""The OpenAI-compatible API, as the `openai` SDK and everything built on it call it: `POST /v1/completions`,
`POST /v1/chat/completions` (the GPT, with the play-script chat template of `service.api.openai.chat_template`),
`GET /v1/models` and `GET /v1/models/{model}`. A thin adapter: OpenAI's request -> `service.serving.generate` ->
OpenAI's response objects and server-sent event chunks (ending with `data: [DONE]`), errors in OpenAI's shape
(`service.errors`), each naming the field of this API (`max_tokens`, not the native `max_new_tokens`). Every
request field has its rule (`service.api.openai.field_rules`): the ignored ones a request sent are named in the
response's X-Ignored-Fields header, streamed or not.

Semantics where the service has a choice (docs/api.md, "OpenAI-compatible API"): `finish_reason` is "stop" for an end of
text or a stop string, "length" at `max_tokens`; `logprobs` are of the model's raw distribution (before
temperature, top-p and penalties, as vLLM's default); `best_of` samples and keeps the `n` best by log-probability
per token, or with temperature 0 is a beam search of that width; `n` choices sample with seeds `seed + i`; a
structured output (`response_format`, vLLM's `structured_outputs` / `guided_*`) is compiled before a stream starts. A
conversation is at most `TSERVE_MAX_TEXT_CHARS` characters of content in all, as a prompt is (checked before it is
rendered; prompts are tokenized on a worker thread).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from service.api.openai import chat_template
from service.api.openai.protocol import OpenAIRequestModels
from service.api.openai.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ModelList,
    OpenAIError,
    OpenAIModel,
)
from service.api.openai.errors import OPENAI, ModelNotFound
from service.api.openai.field_rules import IGNORED_FIELDS_HEADER
from service.api.openai.render import ChatRender, CompletionRender, echo_text
from service.errors import BadInput
from service.http.routing import NOT_JSON_DESCRIPTION, NOT_JSON_STATUS, with_body
from service.repository import GPT
from service.serving import generate as generation
from service.serving.constrain import compile_constraint
from service.serving.context import deadline_of, label, resolve

OWNED_BY = "transformer-serving"
ERRORS = {status: {"model": OpenAIError, "description": text} for status, text in {
    400: "Invalid request (OpenAI answers a malformed request with 400): the message and `param` name the field",
    401: "Missing or wrong API key (when TSERVE_API_KEYS is set)", 404: "Unknown or not loaded model",
    429: "Queue full; retry after the Retry-After header's seconds", 503: "Not ready or draining",
    504: "The request's deadline (TSERVE_DEFAULT_TIMEOUT_MS) expired", NOT_JSON_STATUS: NOT_JSON_DESCRIPTION}.items()}
STREAM_DOC = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or with stream=true OpenAI's "
                    "server-sent chunks ending with `data: [DONE]`.",
                    "headers": {IGNORED_FIELDS_HEADER: {"schema": {"type": "string"}, "description": (
                        "The fields the request sent that were accepted and ignored (labels, or knobs of a hosted "
                        "service: docs/openai-fields.md), comma-separated; absent when there are none.")}}}}


async def _fastapi_response(request: Request, response: Response) -> None:
    """A dependency of the generation routes: FastAPI's response, whose headers it sends with the data a route
    returns, kept on the request (the routes, built by `with_body`, take only the body and the request)."""
    request.state.response = response


def _naming_ignored(request: Request, ignored: list[str], answer):
    """The route's answer, with the ignored fields the request sent in X-Ignored-Fields: on a stream's own
    response, or on FastAPI's for the data it renders."""
    if ignored:
        response = answer if isinstance(answer, Response) else request.state.response
        response.headers[IGNORED_FIELDS_HEADER] = ", ".join(ignored)
    return answer


def build_router(models: OpenAIRequestModels) -> APIRouter:
    router = APIRouter(tags=["openai"], route_class=OPENAI.route_class)
    keeps_response = [Depends(_fastapi_response)]
    router.add_api_route("/v1/completions", with_body(completions, models.completion), methods=["POST"],
                         response_model=CompletionResponse, responses={**ERRORS, **STREAM_DOC},
                         dependencies=keeps_response, summary="OpenAI completions (the GPT)")
    router.add_api_route("/v1/chat/completions", with_body(chat_completions, models.chat), methods=["POST"],
                         response_model=ChatCompletionResponse, responses={**ERRORS, **STREAM_DOC},
                         dependencies=keeps_response,
                         summary="OpenAI chat completions (the GPT, messages rendered as a play)")
    router.add_api_route("/v1/models", list_models, methods=["GET"], response_model=ModelList,
                         summary="Models in the repository and what is loaded (OpenAI's list, with details)")
    router.add_api_route("/v1/models/{model:path}", retrieve_model, methods=["GET"], response_model=OpenAIModel,
                         responses={404: {"model": OpenAIError, "description": "No such model (code "
                                          "`model_not_found`)"}, 401: ERRORS[401]},
                         summary="One model of the repository (an element of the list)")
    return router


def _models(request: Request) -> list[dict]:
    """Every model of the repository (or loaded) as OpenAI's model object, with the service's details."""
    # `created`: the served version folder's time, from the registry
    return [{"id": status.pop("name"), "object": "model", "owned_by": OWNED_BY, **status}
            for status in request.app.state.registry.status()]


async def list_models(request: Request) -> dict:
    return {"object": "list", "data": _models(request)}


async def retrieve_model(model: str, request: Request) -> dict:
    """OpenAI's model object of `model`, as the list has it; 404 `model_not_found` for a name it does not have."""
    found = [entry for entry in _models(request) if entry["id"] == model]
    if not found:
        raise ModelNotFound(f"The model {model!r} does not exist (GET /v1/models lists them)", param="model")
    return found[0]


# --- /v1/completions --------------------------------------------------------------------------------------------

async def completions(body, request: Request):
    """OpenAI completions: one or more prompts, `n` choices each (choice `p * n + i`: prompt p's i-th)."""
    loaded = resolve(request, GPT, body.model, None)
    ignored = body.check_fields()
    n, best_of = body.n or 1, body.best_of
    if best_of is not None and best_of < n:
        raise BadInput(f"best_of ({best_of}) must be >= n ({n})", param="best_of")
    body.check_scoring()
    if body.beam_search and body.logprobs is not None:
        raise BadInput("logprobs is not supported with best_of > 1 at temperature 0 (a beam search, which keeps no "
                       "per-token log-probabilities)", param="logprobs")
    params = body.to_params()
    label(request, loaded, params.mode)
    raw = body.prompt
    prompts = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else raw
    ids = await generation.encode_prompts(loaded, prompts, params.max_new_tokens, "max_tokens")
    tokenizer = loaded.engine.tokenizer
    echoed = [echo_text(tokenizer, p, i) if body.echo else "" for p, i in zip(prompts, ids)]
    deadline = deadline_of(request, None)
    render = CompletionRender(loaded.name, tokenizer, n, sum(len(i) for i in ids), body.include_usage(), echoed,
                              logprobs=body.logprobs, prompt_ids=ids, echo_logprobs=body.echo_logprobs,
                              prompt_logprobs=body.prompt_logprobs)
    if body.stream:
        if best_of is not None and best_of != n:
            raise BadInput("stream is not supported with best_of > n", param="stream")
        params = await compile_constraint(loaded, params)  # before the stream: a bad constraint is a 400
        events = await generation.stream(loaded, ids, params, deadline, n=n)
        return _naming_ignored(request, ignored, render.stream(request, events))
    results = await generation.generate(request, loaded, ids, params, deadline, n=n,
                                        best_of=None if body.beam_search else best_of)
    return _naming_ignored(request, ignored, render.response(results))


# --- /v1/chat/completions ---------------------------------------------------------------------------------------

async def chat_completions(body, request: Request):
    """OpenAI chat completions: the conversation rendered as a play, the model speaking the next turn."""
    loaded = resolve(request, GPT, body.model, None)
    ignored = body.check_fields()
    n, settings = body.n or 1, request.app.state.settings
    if (chars := sum(len(chat_template.message_text(m.content)) for m in body.messages)) > settings.max_text_chars:
        raise BadInput(f"messages: the conversation has {chars} characters; at most {settings.max_text_chars} "
                       "(TSERVE_MAX_TEXT_CHARS, as a prompt)", param="messages")
    prompt = chat_template.render(body.messages)
    # Encoded (and checked against the context) once: with the tokens asked for, else with room for `min_tokens`
    # (at least one) and then as many as the context leaves, up to the server's limit.
    (ids,) = await generation.encode_prompts(loaded, [prompt], *body.token_budget())
    max_tokens = body.requested_tokens or min(settings.max_new_tokens, loaded.engine.context_length - len(ids))
    params = body.to_params(max_tokens)
    label(request, loaded, params.mode)
    deadline = deadline_of(request, None)
    render = ChatRender(loaded.name, loaded.engine.tokenizer, n, len(ids), body.include_usage(),
                        logprobs=bool(body.logprobs))
    if body.stream:
        params = await compile_constraint(loaded, params)  # before the stream: a bad constraint is a 400
        events = await generation.stream(loaded, [ids], params, deadline, n=n)
        return _naming_ignored(request, ignored, render.stream(request, events))
    results = await generation.generate(request, loaded, [ids], params, deadline, n=n)
    return _naming_ignored(request, ignored, render.response(results[0]))
