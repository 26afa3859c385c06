"""Request schemas of the OpenAI-compatible API (`/v1/completions`, `/v1/chat/completions`,
`/v1/models`), as OpenAI documents them and its Python SDK sends them (the responses: `service.api.openai.responses`).

Built per app by `openai_request_models(settings)` (like `service.api.native.protocol`), so the server's limits
are in the schema: a prompt, a chat message's content and each of its text parts are at most
`TSERVE_MAX_TEXT_CHARS` characters, as a native prompt (the conversation as a whole too: the route checks that,
since a schema cannot sum lengths), and every string must be valid Unicode (`service.api.fields.ValidUnicode`).
Every field OpenAI defines has a rule (`service.api.openai.field_rules`, docs/openai-fields.md): honoured, ignored
(only a label or a hosted service's knob: named in the response's X-Ignored-Fields header) or refused with a 400
naming it (`check_fields`); vLLM's sampling extensions (`top_k`, `min_tokens`, `ignore_eos`, `repetition_penalty`)
map onto the native API's options, the structured outputs (`response_format`, vLLM's `structured_outputs` and
`guided_*`) onto one constraint (`service.api.openai.structured`). Each request maps itself to the serving layer's
parameters in one place, its `to_params` (vLLM's `to_sampling_params`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from service.api.fields import (
    MAX_JSON_INTEGER,
    MAX_STOP_STRINGS,
    STRICT,
    Name,
    Seed,
    StopString,
    ValidUnicode,
    integer,
)
from service.api.native.protocol import MAX_REPETITION_PENALTY
from service.api.openai import chat_template, field_rules
from service.api.openai.structured import ConstrainedFields
from service.errors import BadInput
from service.serving.generate import GenerationParams
from service.settings import Settings

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI: 5 for completions, 20 for chat)
MAX_PENALTY = 2.0  # presence / frequency penalty range, as OpenAI's
MAX_TEMPERATURE = 2.0  # OpenAI's range
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
# Text parts of one chat message: OpenAI states no limit; this bounds the objects one message makes the server
# validate (SDKs send one part per text, a few at most), and the characters are bounded by the text limit anyway.
MAX_CONTENT_PARTS = 64
MAX_SPEAKER_CHARS = 64  # a chat message's `name`: OpenAI's limit for it
# ... and what it may hold: the play's speaker line is `NAME:` then a line break (service.api.openai.chat_template),
# so a name with a colon or a line break could forge another speaker's turn
SPEAKER_PATTERN = r"^[^:\r\n]+$"
DEFAULT_TEMPERATURE, DEFAULT_TOP_P = 1.0, 1.0  # OpenAI's defaults: the model's distribution as it is
VLLM_TOP_K_OFF = -1  # vLLM's "no top-k" (as 0 is, the native API's)
NO_REPETITION_PENALTY = 1.0  # a repetition penalty that changes nothing (the default)
# OpenAI's limits of `metadata`: pairs, key and value characters.
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
# An ignored label (`service_tier`, `prompt_cache_key`, `reasoning_effort`, ...): OpenAI's longest is 512 characters.
MAX_LABEL_CHARS = 512
Label = Annotated[str, Field(max_length=MAX_LABEL_CHARS)]


class _OpenAIRequest(BaseModel):
    # The SDK sends only what the caller set; an unknown field is a 400 naming it (as OpenAI answers).
    model_config = STRICT


class StreamOptions(_OpenAIRequest):
    include_usage: StrictBool = Field(False, description="Send a last chunk with the usage (and no choices).")
    include_obfuscation: StrictBool | None = Field(None, description="Ignored: the chunks carry no padding.")


@dataclass(frozen=True)
class OpenAIRequestModels:
    completion: type[BaseModel]
    chat: type[BaseModel]


def openai_request_models(settings: Settings) -> OpenAIRequestModels:
    s = settings
    Text = Annotated[str, Field(min_length=1, max_length=s.max_text_chars)]
    Tokens = Annotated[list[integer(ge=0)], Field(min_length=1, max_length=s.max_text_chars)]
    Choices = integer(ge=1, le=s.max_num_beams)
    Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
    Content = Annotated[str, Field(max_length=s.max_text_chars)]

    class TextPart(_OpenAIRequest):
        type: Literal["text"]
        text: Content

    class ChatMessage(_OpenAIRequest):
        role: Literal["system", "developer", "user", "assistant"]
        content: Content | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] = Field(
            ..., description=f"Text, or a list of up to {MAX_CONTENT_PARTS} text parts (joined); up to "
            f"{s.max_text_chars} characters (TSERVE_MAX_TEXT_CHARS), and so is the whole conversation.")
        name: Annotated[str, Field(min_length=1, max_length=MAX_SPEAKER_CHARS,
                                   pattern=SPEAKER_PATTERN)] | None = Field(
            None, description="The speaker's name in the rendered play (default: ROMEO for user, JULIET for "
            "assistant); no line break or colon, which would start another speaker's turn.",
            examples=["HAMLET"])

    class _Sampling(_OpenAIRequest, ValidUnicode, ConstrainedFields):
        model: Name = Field(..., description="A loaded GPT model (see GET /v1/models), e.g. gpt.", examples=["gpt"])
        temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE)] | None = Field(
            None, description="0 (or below 1e-5) = greedy; default 1.", examples=[0.8])
        top_p: Annotated[float, Field(gt=0, le=1)] | None = Field(None, description="Nucleus sampling; default 1.")
        n: Choices | None = Field(None, description=f"Choices per prompt (at most {s.max_num_beams}); default 1.")
        stream: StrictBool | None = Field(None, description="Server-sent events as OpenAI streams them.")
        stream_options: StreamOptions | None = None
        stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
            None, description=f"Up to {MAX_STOP_STRINGS} stop strings; the text ends before the first.")
        seed: Seed | None = Field(None, description="Same seed, same text (choice i: seed+i).")
        presence_penalty: Penalty | None = Field(None, description="OpenAI's: minus this from every token already "
                                                 "generated.")
        frequency_penalty: Penalty | None = Field(None, description="OpenAI's: minus this times each token's count "
                                                  "so far.")
        logit_bias: dict[str, Any] | None = Field(None, description="Not supported (only empty).")
        user: str | None = Field(None, description="Ignored (valid Unicode, like every string).")
        # vLLM's sampling extensions (the SDK sends them in `extra_body`), mapped onto the native API's options
        top_k: integer(ge=VLLM_TOP_K_OFF, le=MAX_JSON_INTEGER) | None = Field(
            None, description="vLLM's: keep the k most likely tokens; 0 or -1 = off.")
        min_tokens: integer(ge=0, le=s.max_new_tokens) | None = Field(
            None, description="vLLM's: the end of text is blocked before this many tokens (at most max_tokens).")
        ignore_eos: StrictBool | None = Field(None, description="vLLM's: the end of text does not stop a choice.")
        repetition_penalty: Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY)] | None = Field(
            None, description="vLLM's: > 1 discourages tokens already present (prompt included).")
        priority: integer(ge=0, le=MAX_JSON_INTEGER) | None = Field(
            None, description=f"vLLM's: the queue level, lower served first (0 to {s.priority_levels - 1}); "
            "default: the model's.")

        RULES: ClassVar[dict[str, field_rules.FieldRule]]  # each field's rule (the endpoint's table)

        def stops(self) -> list[str]:
            """The stop strings, as a list (OpenAI's `stop` is one string or several)."""
            return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

        def check_fields(self) -> list[str]:
            """Every field's rule applied (`field_rules.check`): a 400 naming the first refused field, else the
            ignored fields the request sent."""
            return field_rules.check(self, self.RULES)

        def include_usage(self) -> bool:
            """Whether a stream ends with a usage chunk (`stream_options.include_usage`)."""
            return bool(self.stream_options and self.stream_options.include_usage)

    class CompletionRequest(_Sampling):
        model_config = ConfigDict(json_schema_extra={"examples": [
            {"model": "gpt", "prompt": "ROMEO:\n", "max_tokens": min(40, s.max_new_tokens), "temperature": 0.8,
             "seed": 7}]})

        prompt: Text | Tokens | Annotated[list[Text], Field(min_length=1, max_length=s.max_texts)] | Annotated[
            list[Tokens], Field(min_length=1, max_length=s.max_texts)] = Field(
            ..., description=f"A prompt, or up to {s.max_texts} (text, or token ids).", examples=["ROMEO:\n"])
        max_tokens: integer(ge=0, le=s.max_new_tokens) | None = Field(
            None, description=f"Most tokens per choice (default {DEFAULT_COMPLETION_TOKENS}); 0 only with echo: "
            "score the prompt, generate nothing.")
        logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = Field(
            None, description=f"Return the log-probability of each token and its top alternatives (0-{MAX_LOGPROBS}); "
            "with echo the prompt's tokens' too (the first one's null).")
        echo: StrictBool | None = Field(None, description="Put the prompt in front of the text (and its tokens in "
                                        "front of the log-probabilities).")
        prompt_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = Field(
            None, description="vLLM's extension: each prompt token's log-probability, rank and this many top "
            "alternatives, in `choices[i].prompt_logprobs` (the first token's null); not with stream.")
        best_of: Choices | None = Field(None, description="Sample this many choices and return the n with the "
                                        "highest log-probability per token; with temperature 0: beam search of "
                                        "this width.")
        suffix: str | None = Field(None, description="Not supported (only null).")

        RULES = field_rules.COMPLETION

        @property
        def beam_search(self) -> bool:
            """`best_of` > 1 at temperature 0: a beam search of width `best_of`, its n best beams the choices."""
            return self.best_of is not None and self.best_of > 1 and self.temperature == 0

        @property
        def echo_logprobs(self) -> bool:
            """`echo` with `logprobs`: the prompt's tokens lead the legacy log-probabilities."""
            return bool(self.echo) and self.logprobs is not None

        def check_scoring(self) -> None:
            """400 naming the field for what prompt scoring cannot do: `max_tokens` 0 without `echo` (nothing to
            return), the prompt's log-probabilities in a stream (only unstreamed responses carry them, as vLLM)."""
            if self.max_tokens == 0 and not self.echo:
                raise BadInput("max_tokens: 0 is allowed only with echo (score the prompt)", param="max_tokens")
            if self.stream and self.prompt_logprobs is not None:
                raise BadInput("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
            if self.stream and self.echo_logprobs:
                raise BadInput("stream with echo and logprobs is not supported: the prompt's log-probabilities "
                               "come only in an unstreamed response", param="stream")

        def to_params(self) -> GenerationParams:
            """The serving parameters of this request; the prompt is scored, with the most top alternatives either
            shape asks, for `echo` + `logprobs` and for `prompt_logprobs`."""
            max_tokens = DEFAULT_COMPLETION_TOKENS if self.max_tokens is None else self.max_tokens
            params = _generation_params(self, max_tokens, self.stops(), self.logprobs,
                                        num_beams=self.best_of if self.beam_search else 1)
            if self.beam_search and params.constraint is not None:
                raise BadInput(f"best_of > 1 at temperature 0 is a beam search, which cannot be constrained "
                               f"({params.constraint.field}): sample (temperature > 0) or use n", param="best_of")
            asked = [top for top in (self.logprobs if self.echo_logprobs else None, self.prompt_logprobs)
                     if top is not None]
            return dataclasses.replace(params, prompt_logprobs=max(asked)) if asked else params

    class ChatRequest(_Sampling):
        model_config = ConfigDict(json_schema_extra={"examples": [
            {"model": "gpt", "messages": [{"role": "user", "content": "What light through yonder window breaks?"}],
             "max_tokens": min(40, s.max_new_tokens), "temperature": 0.8, "seed": 7}]})

        messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=s.max_texts)] = Field(
            ..., description=f"Up to {s.max_texts} messages (TSERVE_MAX_TEXTS) of up to {s.max_text_chars} characters "
            "together (TSERVE_MAX_TEXT_CHARS, as a prompt).")
        max_tokens: integer(ge=1, le=s.max_new_tokens) | None = Field(None, description="Deprecated by OpenAI in "
                                                                       "favour of max_completion_tokens; either.")
        max_completion_tokens: integer(ge=1, le=s.max_new_tokens) | None = Field(
            None, description="Most tokens per choice (default: as many as the context allows, up to "
            f"{s.max_new_tokens}).")
        logprobs: StrictBool | None = Field(None, description="Return each token's log-probability.")
        top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = Field(None, description="Alternatives per token.")
        tools: list[Any] | None = Field(None, description="Not supported (only empty).")
        tool_choice: Any | None = Field(None, description='Only "none" or "auto" (no tools are called).')
        parallel_tool_calls: StrictBool | None = Field(None, description="Ignored.")
        functions: list[Any] | None = Field(None, description="Not supported (only empty).")
        function_call: Any | None = Field(None, description='Only "none" or "auto" (no functions are called).')
        audio: dict[str, Any] | None = Field(None, description="Only null (no audio output).")
        modalities: list[Literal["text", "audio"]] | None = Field(None, description='Only ["text"].')
        web_search_options: dict[str, Any] | None = Field(None, description="Not supported (only null).")
        moderation: dict[str, Any] | None = Field(None, description="Not supported (only null).")
        # accepted and ignored: labels of the request, or knobs of a hosted service (X-Ignored-Fields names them)
        prediction: dict[str, Any] | None = Field(None, description="Ignored (only makes OpenAI's answer faster).")
        reasoning_effort: Label | None = Field(None, description="Ignored (the GPT has no reasoning phase).")
        verbosity: Label | None = Field(None, description="Ignored (the GPT has no verbosity control).")
        metadata: Annotated[dict[Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)],
                                 Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]],
                            Field(max_length=MAX_METADATA_PAIRS)] | None = Field(None, description="Ignored.")
        store: StrictBool | None = Field(None, description="Ignored (nothing is stored).")
        service_tier: Label | None = Field(None, description="Ignored.")
        prompt_cache_key: Label | None = Field(None, description="Ignored.")
        prompt_cache_retention: Label | None = Field(None, description="Ignored.")
        prompt_cache_options: dict[str, Any] | None = Field(None, description="Ignored.")
        safety_identifier: Label | None = Field(None, description="Ignored.")

        RULES = field_rules.CHAT

        @property
        def requested_tokens(self) -> int | None:
            """The most tokens per choice the request names (`max_completion_tokens`, else `max_tokens`), if any."""
            return self.max_completion_tokens or self.max_tokens

        @property
        def tokens_field(self) -> str:
            """The field that names the most tokens per choice, for error messages: `max_completion_tokens` when
            the request sent it, else `max_tokens`."""
            return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

        def token_budget(self) -> tuple[int, str]:
            """The tokens the prompt must leave room for in the context, and the field that asks for them: the
            tokens asked for, else `min_tokens` (at least one)."""
            if self.requested_tokens is not None:
                return self.requested_tokens, self.tokens_field
            return (self.min_tokens, "min_tokens") if self.min_tokens else (1, "max_tokens")

        def to_params(self, max_tokens: int) -> GenerationParams:
            """The serving parameters of this request, `max_tokens` per choice (the route's default fills in what the
            request leaves out: it depends on the prompt's length). The end of a turn is an implicit stop string."""
            top = (self.top_logprobs or 0) if self.logprobs else None
            return _generation_params(self, max_tokens, [*self.stops(), chat_template.END_OF_TURN], top,
                                      tokens_field=self.tokens_field)

    return OpenAIRequestModels(CompletionRequest, ChatRequest)


def _generation_params(body, max_tokens: int, stop: list[str], logprobs: int | None, num_beams: int = 1,
                       tokens_field: str = "max_tokens") -> GenerationParams:
    """What completions and chat requests map alike: sampling, penalties, seed (OpenAI's defaults for what is
    left out) and vLLM's extensions as the native options: `min_tokens` is `min_new_tokens`, `ignore_eos` the end of
    text blocked for all `max_tokens`. 400 when `min_tokens` is above the most tokens (`tokens_field` names them)."""
    min_tokens = max_tokens if body.ignore_eos else body.min_tokens or 0
    if min_tokens > max_tokens:
        raise BadInput(f"min_tokens ({min_tokens}) must be <= {tokens_field} ({max_tokens})", param="min_tokens")
    return GenerationParams(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens,
        temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_k=0 if body.top_k in (None, VLLM_TOP_K_OFF) else body.top_k,
        top_p=DEFAULT_TOP_P if body.top_p is None else body.top_p,
        repetition_penalty=NO_REPETITION_PENALTY if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        seed=body.seed, stop=tuple(stop), num_beams=num_beams, logprobs=logprobs, constraint=body.constraint(),
        priority=body.priority)
