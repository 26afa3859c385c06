"""Response schemas of the OpenAI-compatible API (`/v1/completions`, `/v1/chat/completions`, `/v1/models`, errors),
as OpenAI documents them and its Python SDK reads them: the OpenAPI page's documentation of what
`service.api.openai.render` builds as dicts. The request schemas are `service.api.openai.protocol`'s."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(..., description="Prompt tokens whose keys and values came from the prefix cache "
                               "(not computed again); the output is the same either way.")


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy log-probabilities; with `echo` the prompt's tokens first (the first one's null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """One token of vLLM's `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, description="With the request's prompt_logprobs only (vLLM's extension).")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length"]


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage


class ResponseCacheState(BaseModel):
    enabled: bool = Field(..., description="Whether repeated requests to this version are answered from the cache.")
    enabled_by: str | None = Field(..., description="What turned it on: TSERVE_RESPONSE_CACHE or config.json.")
    store: Literal["local", "redis"] = Field(..., description="Where answers are kept: this process, or Redis.")


class OpenAIModel(BaseModel):
    """OpenAI's model object, with this service's details as extra keys."""

    id: str
    object: Literal["model"]
    created: int = Field(..., description="When the active (else newest) version was written, Unix seconds.")
    owned_by: str
    kind: str
    versions: list[int] = Field(..., description="Versions present in the repository.")
    active_version: int | None = Field(..., description="The version served when a request names none.")
    loaded_versions: list[int]
    provider: str | None
    variant: dict[str, str | dict[str, str]] | None = Field(
        ..., description="How the active version's graphs compute: `weights` (fp32, int8, fp16, fp32+gqa, ...: the "
        "variant that runs; `fp16`: computing in float16, on CUDA; `+gqa`: the in-place step graph's attention as "
        "GroupQueryAttention), `stored_weights` (fp32, fp16, int8: as the repository holds it), `offered_weights` "
        "(the variants the version offers on its provider, comma-separated), `not_offered` (each other variant: "
        "why not, on this provider), `chosen_by` (pinned, only variant, measured, cached measurement) and "
        "`reason`; `attention` (plain, mha) and, for the text models, `kv_cache` (concat, inplace), as its "
        "config.json says; for the GPT `prefix_cache` (on, off) and `prefix_caching` (`enabled`, `block_tokens`, "
        "`budget_bytes`, and `reason` when off), and `speculation` (off, ngram: where its steps speculate); null "
        "when no version is loaded.")
    ready: bool
    response_cache: ResponseCacheState | None = Field(
        None, description="The response cache as the active version sees it (docs/response_cache.md); null when "
        "no version is loaded.")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[OpenAIModel]


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail
