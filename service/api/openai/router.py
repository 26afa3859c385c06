"""The OpenAI-compatible API, as the `openai` SDK and everything built on it call it: `POST /v1/completions`,
`POST /v1/chat/completions` (the GPT, with the play-script chat template of `service.api.openai.chat_template`) and
`GET /v1/models`. A thin adapter: OpenAI's request -> `service.serving.generate` -> OpenAI's response objects and
server-sent event chunks (ending with `data: [DONE]`), errors in OpenAI's shape (`service.errors`).

Semantics where the service has a choice (README, "OpenAI-compatible API"): `finish_reason` is "stop" for an end of
text or a stop string, "length" at `max_tokens`; `logprobs` are of the model's raw distribution (before
temperature, top-p and penalties, as vLLM's default); `best_of` samples and keeps the `n` best by log-probability
per token, or with temperature 0 is a beam search of that width; `n` choices sample with seeds `seed + i`. A
conversation is at most `TSERVE_MAX_TEXT_CHARS` characters of content in all, as a prompt is (checked before it is
rendered; prompts are tokenized on a worker thread).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from tokenizers.decoders import DecodeStream

from service.api.openai import chat_template
from service.errors import BadInput, openai_error_type
from service.api.openai.protocol import (
    DEFAULT_COMPLETION_TOKENS,
    ChatCompletionResponse,
    CompletionResponse,
    ModelList,
    OpenAIError,
    OpenAIRequestModels,
)
from service.models.registry import LoadedModel
from service.http.routing import sse_response, with_body
from service.serving import generate as generation
from service.serving.context import deadline_of, label, resolve
from service.serving.outputs import Completion
from service.serving.streaming import Finished, Piece
from service.client.sse import event as sse_event

OWNED_BY = "transformer-serving"
# JSON has no -inf: a token the model gives no probability at all is reported at this log-probability, as OpenAI does
FLOOR_LOGPROB = -9999.0
ERRORS = {status: {"model": OpenAIError, "description": text} for status, text in {
    400: "Invalid request (OpenAI answers a malformed request with 400): the message and `param` name the field",
    401: "Missing or wrong API key (when TSERVE_API_KEYS is set)", 404: "Unknown or not loaded model",
    429: "Queue full; retry after the Retry-After header's seconds", 503: "Not ready or draining",
    504: "The request's deadline (TSERVE_DEFAULT_TIMEOUT_MS) expired"}.items()}
STREAM_DOC = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or with stream=true OpenAI's "
                    "server-sent chunks ending with `data: [DONE]`."}}


def build_router(models: OpenAIRequestModels) -> APIRouter:
    router = APIRouter(tags=["openai"])
    router.add_api_route("/v1/completions", with_body(completions, models.completion), methods=["POST"],
                         response_model=CompletionResponse, responses={**ERRORS, **STREAM_DOC},
                         summary="OpenAI completions (the GPT)")
    router.add_api_route("/v1/chat/completions", with_body(chat_completions, models.chat), methods=["POST"],
                         response_model=ChatCompletionResponse, responses={**ERRORS, **STREAM_DOC},
                         summary="OpenAI chat completions (the GPT, messages rendered as a play)")
    router.add_api_route("/v1/models", list_models, methods=["GET"], response_model=ModelList,
                         summary="Models in the repository and what is loaded (OpenAI's list, with details)")
    return router


async def list_models(request: Request) -> dict:
    registry = request.app.state.registry
    data = []
    for status in registry.status():  # `created`: the served version folder's time, from the registry
        data.append({"id": status.pop("name"), "object": "model", "owned_by": OWNED_BY, **status})
    return {"object": "list", "data": data}


# --- shared by completions and chat ---------------------------------------------------------------------------

def _unsupported(body) -> None:
    if body.logit_bias:
        raise BadInput("logit_bias is not supported", param="logit_bias")
    if getattr(body, "suffix", None) is not None:
        raise BadInput("suffix is not supported (the model has no fill-in-the-middle training)", param="suffix")
    if getattr(body, "tools", None) or getattr(body, "tool_choice", None) not in (None, "none"):
        raise BadInput("tools are not supported", param="tools")
    response_format = getattr(body, "response_format", None)
    if response_format and response_format.get("type") != "text":
        raise BadInput('response_format: only {"type": "text"} is supported', param="response_format")


def _params(body, max_tokens: int, stop: Sequence[str], logprobs: int | None,
            num_beams: int = 1) -> generation.GenerationParams:
    return generation.GenerationParams(
        max_new_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0, seed=body.seed, stop=tuple(stop), num_beams=num_beams,
        logprobs=logprobs)


def _stops(stop) -> list[str]:
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


def _finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"  # an end of text or a stop string


def _usage(completions: Sequence[Completion], prompt_tokens: int) -> dict:
    """OpenAI's usage: the prompts' tokens (once, whatever n is) and every choice's generated tokens."""
    generated = sum(c.completion_tokens for c in completions)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}


class _TokenText:
    """A token's text as OpenAI reports it, and its bytes: a token that is part of a UTF-8 character (a byte-level
    token) is `bytes:\\xNN`, as OpenAI writes such tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        if token not in self.cache:
            raw = _token_bytes(self.tokenizer, token)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self.cache[token] = (text, list(raw))
        return self.cache[token]


def _token_bytes(tokenizer, token: int) -> bytes:
    """A token's bytes: through GPT-2's byte-to-character map for a byte-level vocabulary, else its decoded text."""
    piece = tokenizer.id_to_token(token) or ""
    if type(tokenizer.decoder).__name__ == "ByteLevel" and all(ch in _BYTE_OF for ch in piece):
        return bytes(_BYTE_OF[ch] for ch in piece)
    return tokenizer.decode([token]).encode("utf-8")


def _gpt2_byte_map() -> dict[str, int]:
    """GPT-2's reversible byte -> printable character map (what `tokenizers`' ByteLevel uses), inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF = _gpt2_byte_map()


def _text_offsets(tokenizer, tokens: Sequence[int], start: int) -> list[int]:
    """Where each token's text begins in the returned text (a token that completes a character starts it)."""
    stream, offsets, position = DecodeStream(skip_special_tokens=True), [], start
    for token in tokens:
        offsets.append(position)
        piece = stream.step(tokenizer, token)
        position += len(piece) if piece else 0
    return offsets


def _completion_logprobs(loaded: LoadedModel, logprobs: Sequence, tokens: Sequence[int], start: int,
                         token_text: _TokenText) -> dict:
    """OpenAI's legacy `logprobs` object for the given tokens."""
    return {"tokens": [token_text(t)[0] for t in tokens],
            "token_logprobs": [max(lp.logprob, FLOOR_LOGPROB) for lp in logprobs],
            "top_logprobs": [{token_text(t)[0]: max(value, FLOOR_LOGPROB) for t, value in lp.top} for lp in logprobs],
            "text_offset": _text_offsets(loaded.engine.tokenizer, tokens, start)}


def _chat_logprobs(logprobs: Sequence, token_text: _TokenText) -> dict:
    """OpenAI's chat `logprobs` object: per token its text, log-probability, bytes and top alternatives."""
    def entry(token: int, value: float) -> dict:
        text, raw = token_text(token)
        return {"token": text, "logprob": max(value, FLOOR_LOGPROB), "bytes": raw}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}


@dataclass
class _ChoiceDelta:
    """What one choice gained in one wake-up: its pieces merged (OpenAI sends one entry per choice per chunk)."""

    choice: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    completion: Completion | None = None  # set when the choice finished


def _merge(batch: Sequence[Piece | Finished]) -> tuple[list[_ChoiceDelta], list[Finished]]:
    """The batch's events per choice, in order of first appearance; and the choices that failed. A choice whose
    events carry nothing to send (tokens held back as a possible stop string, no log-probabilities asked for)
    has no delta: an empty `content` chunk would only cost the client a parse."""
    deltas: dict[int, _ChoiceDelta] = {}
    failed = []
    for event in batch:
        if isinstance(event, Finished) and event.error is not None:
            failed.append(event)
            deltas.pop(event.choice, None)
            continue
        delta = deltas.setdefault(event.choice, _ChoiceDelta(event.choice))
        if isinstance(event, Piece):
            delta.text += event.text
            delta.token_ids += event.token_ids
            delta.logprobs += event.logprobs or []
        else:
            delta.text += event.rest
            delta.completion = event.completion
    moved = [d for d in deltas.values() if d.text or d.logprobs or d.completion is not None]
    return moved, failed


def _stream(request: Request, events: AsyncIterator[list[Piece | Finished]],
            chunk: Callable[[list[dict]], dict], choice_delta: Callable[[_ChoiceDelta], dict],
            usage: Callable[[], dict] | None, first: list[dict] | None = None) -> StreamingResponse:
    """OpenAI's server-sent chunks: `first` choices (chat: the role), then one chunk per wake-up with one entry
    per choice that moved, then (with `stream_options.include_usage`) a usage chunk without choices, then [DONE].
    A choice that fails after the status was sent ends the stream with an error event, as vLLM's, of the type the
    same error has unstreamed (`openai_error_type`: a deadline is a timeout_error either way)."""

    async def chunks() -> AsyncIterator[bytes]:
        if first:
            yield sse_event(chunk(first))
        async for batch in events:
            deltas, failed = _merge(batch)
            if deltas:
                yield sse_event(chunk([choice_delta(delta) for delta in deltas]))
            for event in failed:  # the middleware counts this reason
                request.state.failure_reason = event.error.reason
                yield sse_event({"error": {"message": event.error.message,
                                           "type": openai_error_type(event.error.status), "param": None,
                                           "code": event.error.type}})
        if usage is not None:
            yield sse_event({**chunk([]), "usage": usage()})

    return sse_response(request, chunks(), events)


# --- /v1/completions --------------------------------------------------------------------------------------------

async def completions(body, request: Request):
    """OpenAI completions: one or more prompts, `n` choices each (choice `p * n + i`: prompt p's i-th)."""
    loaded = resolve(request, "gpt", body.model, None)
    _unsupported(body)
    n, best_of = body.n or 1, body.best_of
    if best_of is not None and best_of < n:
        raise BadInput(f"best_of ({best_of}) must be >= n ({n})", param="best_of")
    if body.echo and body.logprobs is not None:
        raise BadInput("echo with logprobs is not supported: the prompt's log-probabilities are not computed",
                       param="echo")
    greedy_ranked = best_of is not None and best_of > 1 and body.temperature == 0  # beam search of width best_of
    if greedy_ranked and body.logprobs is not None:
        raise BadInput("logprobs is not supported with best_of > 1 at temperature 0 (a beam search, which keeps no "
                       "per-token log-probabilities)", param="logprobs")
    max_tokens = body.max_tokens or DEFAULT_COMPLETION_TOKENS
    params = _params(body, max_tokens, _stops(body.stop), body.logprobs, num_beams=best_of if greedy_ranked else 1)
    label(request, loaded, params.mode)
    raw = body.prompt
    prompts = [raw] if isinstance(raw, str) or (raw and isinstance(raw[0], int)) else raw
    ids = await generation.encode_prompts(loaded, prompts, max_tokens)
    tokenizer = loaded.engine.tokenizer
    echoed = [(p if isinstance(p, str) else tokenizer.decode(i)) if body.echo else "" for p, i in zip(prompts, ids)]
    deadline = deadline_of(request, None)
    completion_id, created, token_text = f"cmpl-{uuid.uuid4().hex}", int(time.time()), _TokenText(tokenizer)

    def logprobs_of(logprobs, tokens, start) -> dict | None:
        return None if body.logprobs is None else _completion_logprobs(loaded, logprobs or [], tokens, start,
                                                                       token_text)

    if body.stream:
        if best_of is not None and best_of != n:
            raise BadInput("stream is not supported with best_of > n", param="stream")
        finished: list[Completion] = []
        sent = [0] * (len(ids) * n)  # characters sent per choice (text offsets of streamed log-probabilities)

        def chunk(choices: list[dict]) -> dict:
            out = {"id": completion_id, "object": "text_completion", "created": created, "model": loaded.name,
                   "choices": choices}
            return {**out, "usage": None} if include_usage else out

        def delta(d: _ChoiceDelta) -> dict:
            prefix = echoed[d.choice // n] if sent[d.choice] == 0 else ""
            if d.completion is not None:
                finished.append(d.completion)
            choice = {"index": d.choice, "text": prefix + d.text,
                      "logprobs": logprobs_of(d.logprobs, d.token_ids, sent[d.choice] + len(prefix)),
                      "finish_reason": None if d.completion is None else _finish_reason(d.completion.finish_reason)}
            sent[d.choice] += len(prefix) + len(d.text)
            return choice

        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        usage = (lambda: _usage(finished, sum(len(i) for i in ids))) if include_usage else None
        return _stream(request, generation.stream(loaded, ids, params, deadline, n=n), chunk, delta, usage)

    results = await generation.generate(request, loaded, ids, params, deadline, n=n,
                                        best_of=None if greedy_ranked else best_of)
    choices, everything = [], []
    for p, group in enumerate(results):
        for i, c in enumerate(group):
            everything.append(c)
            choices.append({"index": p * n + i, "text": echoed[p] + c.text,
                            "logprobs": logprobs_of(c.logprobs, c.token_ids, len(echoed[p])),
                            "finish_reason": _finish_reason(c.finish_reason)})
    return {"id": completion_id, "object": "text_completion", "created": created, "model": loaded.name,
            "choices": choices, "usage": _usage(everything, sum(len(i) for i in ids))}


# --- /v1/chat/completions ---------------------------------------------------------------------------------------

async def chat_completions(body, request: Request):
    """OpenAI chat completions: the conversation rendered as a play, the model speaking the next turn."""
    loaded = resolve(request, "gpt", body.model, None)
    _unsupported(body)
    n = body.n or 1
    limit = request.app.state.settings.max_text_chars
    if (chars := sum(len(chat_template.message_text(m.content)) for m in body.messages)) > limit:
        raise BadInput(f"messages: the conversation has {chars} characters; at most {limit} (TSERVE_MAX_TEXT_CHARS, "
                       "as a prompt)", param="messages")
    prompt = chat_template.render(body.messages)
    (ids,) = await generation.encode_prompts(loaded, [prompt], 1)
    room = loaded.engine.context_length - len(ids)
    max_tokens = body.max_completion_tokens or body.max_tokens or min(request.app.state.settings.max_new_tokens, room)
    ids = generation.encode_prompt(loaded, ids, max_tokens)  # token ids: only checked against the context
    top = (body.top_logprobs or 0) if body.logprobs else None
    params = _params(body, max_tokens, [*_stops(body.stop), chat_template.END_OF_TURN], top)
    label(request, loaded, params.mode)
    deadline = deadline_of(request, None)
    completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    token_text = _TokenText(loaded.engine.tokenizer)

    def logprobs_of(logprobs) -> dict | None:
        return _chat_logprobs(logprobs or [], token_text) if body.logprobs else None

    if body.stream:
        finished: list[Completion] = []
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices: list[dict]) -> dict:
            out = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": loaded.name,
                   "choices": choices}
            return {**out, "usage": None} if include_usage else out

        def delta(d: _ChoiceDelta) -> dict:
            if d.completion is None:
                return {"index": d.choice, "delta": {"content": d.text}, "logprobs": logprobs_of(d.logprobs),
                        "finish_reason": None}
            finished.append(d.completion)
            return {"index": d.choice, "delta": {"content": d.text} if d.text else {},
                    "logprobs": logprobs_of(d.logprobs), "finish_reason": _finish_reason(d.completion.finish_reason)}

        first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                 for i in range(n)]
        usage = (lambda: _usage(finished, len(ids))) if include_usage else None
        return _stream(request, generation.stream(loaded, [ids], params, deadline, n=n), chunk, delta, usage, first)

    results = (await generation.generate(request, loaded, [ids], params, deadline, n=n))[0]
    choices = [{"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs_of(c.logprobs),
                "finish_reason": _finish_reason(c.finish_reason)} for i, c in enumerate(results)]
    return {"id": completion_id, "object": "chat.completion", "created": created, "model": loaded.name,
            "choices": choices, "usage": _usage(results, len(ids))}
