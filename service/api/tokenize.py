"""vLLM's tokenizer endpoints (`vllm/entrypoints/serve/tokenize`), for the models with a tokenizer (`gpt`, the
default, and `translation`): what lm-eval's `tokenizer_backend=remote` calls. `/tokenize`: a `prompt`, or chat
`messages` rendered as `/v1/chat/completions` renders them -> `{count, max_model_len, tokens, token_strs}`, never
truncated (`add_special_tokens` adds what the model adds to a text: the translator's end-of-source token);
`/detokenize`: `tokens` -> `{prompt}`, special tokens kept (ids -> text -> ids round-trips); `/tokenizer_info`:
what a `tokenizer_config.json` says.

The tokenizer is the model version's own (`engine.tokenizer`), leased like every model use; encoding and decoding run
on a worker thread through `tokenizers`' batch calls, which release the GIL (its single `encode`/`decode` hold it,
and the event loop would wait). The bound is the routes' own (`TSERVE_MAX_TOKENIZE_CHARS`: a prompt's characters,
`tokens`' ids), above a generation prompt's, as lm-eval tokenizes whole documents; memory grows with it (~220 bytes
a character in the GPT's byte tokenizer). Errors in OpenAI's shape: 400 naming the field (past the bound, an id
outside the vocabulary), 404 naming `model` (unknown, or without a tokenizer). Unlike vLLM's, these routes need the
API key when keys are configured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from starlette.concurrency import run_in_threadpool

from service.api.fields import MAX_JSON_INTEGER, MAX_NAME_CHARS, STRICT, Name, ValidUnicode, integer
from service.api.openai import chat_template
from service.api.openai.errors import OPENAI
from service.api.openai.responses import OpenAIError
from service.errors import BadInput, NotFound
from service.http.routing import NOT_JSON_DESCRIPTION, NOT_JSON_STATUS, with_body
from service.models.registry import LoadedModel
from service.repository import GPT, TRANSLATION
from service.serving.context import label, resolve
from service.settings import Settings

# What a model without `model` in the request is: the GPT, as every OpenAI-compatible route (lm-eval names none).
DEFAULT_MODEL = GPT
# The class Hugging Face loads a `tokenizer.json` alone with: what `tokenizer_info` reports, as vLLM does.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
# The chat template's turn for the model: what `add_generation_prompt` adds after the conversation.
GENERATION_PROMPT = f"{chat_template.ASSISTANT_SPEAKER}:\n"
# The metrics' `mode` label of these requests: none of the decoding modes (`service.observability.metrics`).
NO_MODE = ""


@dataclass(frozen=True)
class TextInput:
    """What a kind's model does to a text's ids before it reads them, and the most ids it reads."""

    max_model_len: int
    appended: list[int]  # the special ids the model appends (`add_special_tokens`)
    bos_id: int | None
    eos_id: int
    pad_id: int | None


# The kinds with a tokenizer, from their engines: the GPT reads a prompt's ids as they are, up to its context
# (`GPTEngine.prefill`); the translator appends the end-of-source token (`TranslationEngine.source_ids`).
TEXT_INPUTS: dict[str, Callable[[object], TextInput]] = {
    GPT: lambda engine: TextInput(engine.context_length, [], None, engine.eos_id, None),
    TRANSLATION: lambda engine: TextInput(engine.max_source_length, [engine.eos_id], engine.bos_id, engine.eos_id,
                                          engine.pad_id),
}


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """The tokenizer's configuration, as Hugging Face's `tokenizer_config.json` holds it (more keys may follow)."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    model_max_length: int
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None


@dataclass(frozen=True)
class TokenizeRequestModels:
    tokenize: type[BaseModel]
    detokenize: type[BaseModel]


def tokenize_request_models(settings: Settings, chat_request: type[BaseModel]) -> TokenizeRequestModels:
    """The request schemas, with the server's limits: a prompt or a token list up to the tokenizer routes' bound
    (`max_tokenize_chars`), and a chat's `messages` exactly as `/v1/chat/completions` takes them (`chat_request`'s
    field)."""
    messages = chat_request.model_fields["messages"]
    Messages = Annotated[messages.annotation, *messages.metadata]
    most = settings.max_tokenize_chars
    Prompt = Annotated[str, Field(max_length=most)]
    TokenId = integer(ge=0, le=MAX_JSON_INTEGER)

    class TokenizeRequest(ValidUnicode):
        model_config = ConfigDict(**STRICT, json_schema_extra={"examples": [
            {"model": "gpt", "prompt": "ROMEO:\n", "return_token_strs": True}]})

        model: Name | None = Field(None, description="gpt (the default) or translation.")
        prompt: Prompt | None = Field(None, description=f"A text of up to {most} characters "
                                      "(TSERVE_MAX_TOKENIZE_CHARS), or give `messages`.")
        messages: Messages | None = Field(None, description="A chat, rendered as /v1/chat/completions renders it "
                                          "(or give `prompt`).")
        add_special_tokens: StrictBool | None = Field(
            None, description="Add what the model adds to a text it reads (the translator: the end-of-source "
            "token; the GPT: nothing). Default: true for a prompt, false for messages.")
        add_generation_prompt: StrictBool | None = Field(
            None, description="Messages only: end with the model's turn (default true).")
        continue_final_message: StrictBool | None = Field(
            None, description="Messages only: leave the last message open, for the model to continue it.")
        return_token_strs: StrictBool | None = Field(False, description="Also return each id's vocabulary string.")

    class DetokenizeRequest(ValidUnicode):
        model_config = ConfigDict(**STRICT, json_schema_extra={"examples": [
            {"model": "gpt", "tokens": [82, 79, 77, 69, 79, 58, 10]}]})

        model: Name | None = Field(None, description="gpt (the default) or translation.")
        tokens: Annotated[list[TokenId], Field(max_length=most)] = Field(
            ..., description=f"Up to {most} token ids of the model's vocabulary (TSERVE_MAX_TOKENIZE_CHARS).")

    return TokenizeRequestModels(TokenizeRequest, DetokenizeRequest)


ERRORS = {status: {"model": OpenAIError, "description": text} for status, text in {
    400: "The body does not conform (the message and `param` name the field), a prompt or token list past "
         "TSERVE_MAX_TOKENIZE_CHARS, an id outside the vocabulary, or both or neither of prompt and messages",
    404: "Unknown model, or a model without a tokenizer (`param`: model)", 503: "Not ready or draining",
    NOT_JSON_STATUS: NOT_JSON_DESCRIPTION}.items()}


def build_router(settings: Settings, chat_request: type[BaseModel]) -> APIRouter:
    """The tokenizer routes; `chat_request`: the app's `/v1/chat/completions` request model (its `messages`)."""
    models = tokenize_request_models(settings, chat_request)
    router = APIRouter(tags=["tokenizer"], route_class=OPENAI.route_class)
    router.add_api_route("/tokenize", with_body(tokenize, models.tokenize), methods=["POST"],
                         response_model=TokenizeResponse, responses=ERRORS,
                         summary="A text's or a chat's token ids, with the model's tokenizer (vLLM's)")
    router.add_api_route("/detokenize", with_body(detokenize, models.detokenize), methods=["POST"],
                         response_model=DetokenizeResponse, responses=ERRORS,
                         summary="The text of token ids, with the model's tokenizer (vLLM's)")
    router.add_api_route("/tokenizer_info", tokenizer_info, methods=["GET"], response_model=TokenizerInfoResponse,
                         responses=ERRORS, summary="The tokenizer's configuration (vLLM's, as tokenizer_config.json)")
    return router


def _resolve(request: Request, name: str | None) -> tuple[LoadedModel, TextInput]:
    """The loaded model that `name` (default: the GPT) names, leased and labelled (no decoding mode: nothing is
    decoded), with what its model does to a text; 404 naming `model` for an unknown one or one without a tokenizer."""
    try:
        loaded = resolve(request, None, name or DEFAULT_MODEL, None)
    except NotFound as error:
        error.param = "model"
        raise
    if loaded.kind not in TEXT_INPUTS:
        raise NotFound(f"model {loaded.name!r} is a {loaded.kind} model, which has no tokenizer (models with one: "
                       f"the {' and '.join(sorted(TEXT_INPUTS))} kinds)", param="model")
    label(request, loaded, NO_MODE)
    return loaded, TEXT_INPUTS[loaded.kind](loaded.engine)


def _chat_prompt(body) -> str:
    """The chat template's text of the conversation: with the model's turn after it, or without, or with the last
    message left open (`render` ends every message with END_OF_TURN, then the model's turn)."""
    if body.continue_final_message and body.add_generation_prompt:
        raise BadInput("continue_final_message and add_generation_prompt cannot both be true",
                       param="continue_final_message")
    prompt = chat_template.render(body.messages)
    if body.continue_final_message:
        return prompt.removesuffix(chat_template.END_OF_TURN + GENERATION_PROMPT)
    if body.add_generation_prompt is False:
        return prompt.removesuffix(GENERATION_PROMPT)
    return prompt


async def tokenize(body, request: Request) -> dict:
    """Token ids of a prompt, or of a chat rendered as the chat route renders it."""
    if (body.prompt is None) == (body.messages is None):
        raise BadInput("give either prompt or messages", param="prompt")
    if body.prompt is not None:
        chat_only = [f for f in ("add_generation_prompt", "continue_final_message") if getattr(body, f) is not None]
        if chat_only:
            raise BadInput(f"{chat_only[0]} applies to messages, not to a prompt", param=chat_only[0])
    loaded, text_input = _resolve(request, body.model)
    text = body.prompt if body.prompt is not None else _chat_prompt(body)
    special = body.add_special_tokens if body.add_special_tokens is not None else body.prompt is not None
    tokenizer = loaded.engine.tokenizer

    def encode() -> tuple[list[int], list[str] | None]:
        (encoding,) = tokenizer.encode_batch([text], add_special_tokens=special)  # the GIL released meanwhile
        ids = encoding.ids + (text_input.appended if special else [])
        return ids, [tokenizer.id_to_token(i) for i in ids] if body.return_token_strs else None

    ids, strings = await run_in_threadpool(encode)
    return {"count": len(ids), "max_model_len": text_input.max_model_len, "tokens": ids, "token_strs": strings}


async def detokenize(body, request: Request) -> dict:
    """The text of token ids (special tokens kept)."""
    loaded, _ = _resolve(request, body.model)
    tokenizer = loaded.engine.tokenizer
    vocabulary = tokenizer.get_vocab_size(with_added_tokens=True)
    for index, token in enumerate(body.tokens):
        if token >= vocabulary:
            raise BadInput(f"tokens.{index}: {token} is not a token id of model {loaded.name!r} (its vocabulary: "
                           f"[0, {vocabulary}))", param=f"tokens.{index}")
    (text,) = await run_in_threadpool(lambda: tokenizer.decode_batch([body.tokens], skip_special_tokens=False))
    return {"prompt": text}


async def tokenizer_info(request: Request, model: Annotated[str | None, Query(
        min_length=1, max_length=MAX_NAME_CHARS, description="gpt (the default) or translation.")] = None) -> dict:
    """The tokenizer's configuration, as `tokenizer_config.json` states it (lm-eval reads the special tokens)."""
    loaded, text_input = _resolve(request, model)
    tokenizer = loaded.engine.tokenizer

    def token(token_id: int | None) -> str | None:
        return None if token_id is None else tokenizer.id_to_token(token_id)

    added = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                      "single_word": t.single_word, "special": t.special}
             for i, t in sorted(tokenizer.get_added_tokens_decoder().items())}
    return {"tokenizer_class": TOKENIZER_CLASS, "model_max_length": text_input.max_model_len,
            "bos_token": token(text_input.bos_id), "eos_token": token(text_input.eos_id),
            "pad_token": token(text_input.pad_id), "unk_token": getattr(tokenizer.model, "unk_token", None),
            "add_bos_token": False, "add_eos_token": text_input.eos_id in text_input.appended,
            "clean_up_tokenization_spaces": False, "added_tokens_decoder": added,
            "model": loaded.name, "version": loaded.version}
