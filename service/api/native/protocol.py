"""Request and response schemas of the HTTP API (pydantic), with the examples the OpenAPI page shows.

The schema is the contract: every limit a request must keep is in it. The request models are built per app by
`request_models(settings)`, so the limits that are settings (text length, number of texts, new tokens, beams,
images, deadline) appear in `/openapi.json` as maxLength / maxItems / maximum and are enforced by the same
validation; anything that does not conform is a 422 naming the field. Validation is strict (`"stream": 0` is not a
boolean, `"4"` is not an integer) and every string must be valid Unicode: a lone surrogate (which JSON can carry as
an escape, and no UTF-8 can) in any string or field name is a 422 naming where it is, before any field is read
(`service.api.fields.ValidUnicode`, shared with the OpenAI-compatible and Open Inference Protocol requests). What
a schema cannot express is checked by the routes and answered 400 with the reason: a prompt whose tokens plus
`max_new_tokens` exceed the model's context, `num_return_sequences` above `num_beams`, `min_new_tokens` above
`max_new_tokens`, an image that does not decode, score targets that do not pair with their sources or are too long
for the model, an output constraint that does not compile or a second one. Each text request maps itself to the
serving layer's parameters in one place, its `to_params` (vLLM's `to_sampling_params`); the Open Inference
Protocol's options reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from service.decoding.beam import MAX_LENGTH_PENALTY
from service.api.constraint_fields import NATIVE_FIELDS, one_constraint
from service.api.fields import (
    MAX_JSON_INTEGER,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    STRICT,
    Name,
    Seed,
    StopString,
    ValidUnicode,
    integer,
)
from service.serving.generate import GenerationParams
from service.serving.translate import TranslationParams
from service.settings import Settings

MAX_NGRAM_SIZE = 10  # the longest n-gram `no_repeat_ngram_size` may forbid: longer ones never repeat in a sentence
MAX_TEMPERATURE = 5.0  # beyond it sampling is as good as uniform
MAX_REPETITION_PENALTY = 10.0  # beyond it a token already present is as good as banned
NON_BLANK = r"\S"  # a JSON-schema pattern (unanchored): at least one character that is not whitespace
# Beam width of a translation that names none: what the translator was validated with (and below it, what fits).
DEFAULT_NUM_BEAMS = 4
DEFAULT_GENERATE_TOKENS = 64  # `max_new_tokens` of a generate request that names none (below it, what fits)
DEFAULT_TOP_K_LABELS = 5  # predictions per image of a classify request that names no top_k
# The OpenAPI page's examples must be valid requests: these values, or the settings' limit when that is lower.
EXAMPLE_NEW_TOKENS, EXAMPLE_TEXT_TIMEOUT_MS, EXAMPLE_IMAGE_TIMEOUT_MS = 40, 10_000, 5_000
# A base64 image of n bytes is 4 characters per 3 bytes (rounded up); allow line breaks every 76 (as `base64`
# wraps) and a `data:image/...;base64,` prefix on top.
BASE64_CHARS_PER_GROUP, BYTES_PER_GROUP = 4, 3
BASE64_LINE, DATA_URL_PREFIX_CHARS = 76, 64
# A 28x28 PNG of a Fashion-MNIST ankle boot (test image 0): the example the OpenAPI page offers, and it works.
EXAMPLE_PNG_BASE64 = (
    "iVBORw0KGgoAAAANSUhEUgAAABwAAAAcCAAAAABXZoBIAAABUElEQVR42t3Su0rDYBgG4Pf78ydpDk0roQcVPAylaJFOoljciu7i4uCiixfgfQkO"
    "Tl6Bo5Pgoqhoiya2aWqb/AcHQdA70G98H953+oB/fQYBNhoA+xETw/y+JzUwxd5vhMJ25xgAqocJwH8OivWVXuMscu7D4PFXkwlvnwpFYtTKY/6N"
    "BEYwFE56L06hJ1WaWYH3hQQNpQ2Jg/rLqPzWz7kJ5jW+UINxgsRR+yEsO8OiGueksQsOMGhSCpjbc259O8y0CzmVqeqAG1IBGpWl5mw2LAemrRbN"
    "91yxDyNpcYnaouc5y24+YiVHuOOp9VxyY38mrYcc3TlRMaRI/DrZMfONdDSoArFybMF3jm+eE5YZlFiqSI4y67VViyF1J6M+v9pc60AkUTSwKGy6"
    "gW5f33VtDfE0LBIAf6O5VQk80iq6ubyYAOcLr0kipqd/65k+AWKCff9NOm1OAAAAAElFTkSuQmCC")


def base64_chars(max_bytes: int) -> int:
    """The longest base64 text (line-wrapped, with a data-URL prefix) of a file of at most `max_bytes` bytes."""
    chars = BASE64_CHARS_PER_GROUP * -(-max_bytes // BYTES_PER_GROUP)
    return chars + chars // BASE64_LINE + DATA_URL_PREFIX_CHARS


class _Strict(ValidUnicode):
    model_config = STRICT


def _model_field(default: str):
    return Field(None, description=f"Model name in the repository; default: {default}.", examples=[default])


@dataclass(frozen=True)
class RequestModels:
    """One app's request models, with its settings' limits in them."""

    translate: type[BaseModel]
    generate: type[BaseModel]
    classify: type[BaseModel]
    score: type[BaseModel]


def request_models(settings: Settings) -> RequestModels:
    """The request models of an app served with `settings` (limits as maxLength / maxItems / maximum)."""
    s = settings
    Text = Annotated[str, Field(min_length=1, max_length=s.max_text_chars, pattern=NON_BLANK)]
    Texts = Annotated[list[Text], Field(min_length=1, max_length=s.max_texts)]
    NewTokens, Beams = integer(ge=1, le=s.max_new_tokens), integer(ge=1, le=s.max_num_beams)
    MinNewTokens, NGramSize = integer(ge=0, le=s.max_new_tokens), integer(ge=0, le=MAX_NGRAM_SIZE)
    Version, Timeout = integer(ge=1), integer(ge=1, le=s.max_timeout_ms)
    QueueLevel = integer(ge=0, le=s.priority_levels - 1)
    timeout_doc = (f"Deadline for queueing + decoding, in milliseconds; default {s.default_timeout_ms} "
                   f"(TSERVE_DEFAULT_TIMEOUT_MS), at most {s.max_timeout_ms} (TSERVE_MAX_TIMEOUT_MS). Past it: 504.")
    version_doc = "Model version; default: the highest loaded version."
    priority_doc = (f"Queue level, lower served first: 0 (most urgent) to {s.priority_levels - 1} "
                    "(TSERVE_PRIORITY_LEVELS); default: the model's (TSERVE_DEFAULT_PRIORITY). docs/priority.md.")
    some_new_tokens = min(EXAMPLE_NEW_TOKENS, s.max_new_tokens)
    default_beams = min(DEFAULT_NUM_BEAMS, s.max_num_beams)
    text_timeout = min(EXAMPLE_TEXT_TIMEOUT_MS, s.max_timeout_ms)
    image_timeout = min(EXAMPLE_IMAGE_TIMEOUT_MS, s.max_timeout_ms)

    class TranslateRequest(_Strict):
        model_config = ConfigDict(json_schema_extra={
            "examples": [{"text": "Ein Mann fährt Fahrrad.", "num_beams": default_beams}],
            # stream=true needs greedy decoding of a single text
            "if": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
            "then": {"properties": {"num_beams": {"const": 1}, "text": {"type": "string"}},
                     "required": ["num_beams"]}})

        text: Text | Annotated[list[Text], Field(min_length=1, max_length=s.max_texts)] = Field(
            ..., description=f"German sentence, or a list of up to {s.max_texts} sentences (TSERVE_MAX_TEXTS), each "
            f"up to {s.max_text_chars} characters (TSERVE_MAX_TEXT_CHARS).", examples=["Ein Mann fährt Fahrrad."])
        num_beams: Beams = Field(default_beams, description="Beam width; 1 = greedy decoding.",
                                 examples=[default_beams])
        length_penalty: float | None = Field(
            None, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY, examples=[1.0],
            description="Beam score = sum of log-probs / generated_length ** length_penalty. Default: the model's, "
            "chosen on validation when it was trained (`generation` in its config.json; 1.0 without one).")
        early_stopping: StrictBool | Literal["never"] = Field(
            False, description='Beam stopping rule, as in transformers: true, false or "never".', examples=[False])
        num_return_sequences: Beams = Field(1, description="Size of the n-best list per sentence (<= num_beams; more "
                                            "is a 400).", examples=[1])
        max_new_tokens: NewTokens | None = Field(None, description="Most tokens to generate per sentence; default: "
                                                 "twice the source length + 10.", examples=[some_new_tokens])
        min_new_tokens: MinNewTokens = Field(0, description="End of sentence is blocked before this many tokens (at "
                                             "most max_new_tokens when that is given; more is a 400).", examples=[0])
        no_repeat_ngram_size: NGramSize = Field(0, description="Forbid repeating any n-gram of this size (every "
                                                "decoding mode, as transformers); 0 = off.", examples=[0])
        target_prefix: str | None = Field(
            None, max_length=s.max_text_chars, examples=["A man"],
            description="English text every translation starts with (CTranslate2's target_prefix): forced, then the "
            "search continues from it (greedy and beams); the text returned (and streamed, first) begins with it. "
            "Tokenized on its own, so end it at a word boundary; whitespace at its ends is dropped; empty = none. "
            "max_new_tokens and min_new_tokens count the tokens after it, and the score leaves it out. 400 when the "
            "vocabulary cannot write it or it leaves no room in the model's target length.")
        stream: StrictBool = Field(False, description="Server-sent events, one per token (needs num_beams=1 and one "
                                   "text).", examples=[False])
        model: Name | None = _model_field("translation")
        version: Version | None = Field(None, description=version_doc, examples=[1])
        timeout_ms: Timeout | None = Field(None, description=timeout_doc, examples=[text_timeout])
        priority: QueueLevel | None = Field(None, description=priority_doc, examples=[1])

        def to_params(self) -> TranslationParams:
            """The serving parameters of this request (the Open Inference Protocol's translation options too)."""
            return TranslationParams(
                num_beams=self.num_beams, length_penalty=self.length_penalty, early_stopping=self.early_stopping,
                num_return_sequences=self.num_return_sequences, max_new_tokens=self.max_new_tokens,
                min_new_tokens=self.min_new_tokens, no_repeat_ngram_size=self.no_repeat_ngram_size,
                target_prefix=self.target_prefix or None, priority=self.priority)

    class GenerateRequest(_Strict):
        model_config = ConfigDict(json_schema_extra={
            "examples": [{"prompt": "ROMEO:\n", "max_new_tokens": some_new_tokens, "temperature": 0.8, "top_k": 40,
                          "seed": 7}],
            "if": {"properties": {"stream": {"const": True}}, "required": ["stream"]},  # streaming is not for beams
            "then": {"properties": {"num_beams": {"const": 1}}}})

        prompt: str = Field(..., min_length=1, max_length=s.max_text_chars, description="Text to continue (up to "
                            f"{s.max_text_chars} characters, TSERVE_MAX_TEXT_CHARS; its tokens plus max_new_tokens "
                            "must fit the model's context, else 400).", examples=["ROMEO:\n"])
        max_new_tokens: NewTokens = Field(min(DEFAULT_GENERATE_TOKENS, s.max_new_tokens),
                                          description="Most tokens (bytes) to generate.", examples=[some_new_tokens])
        min_new_tokens: MinNewTokens = Field(0, description="End of text is blocked before this many tokens (at "
                                             "most max_new_tokens; more is a 400).", examples=[0])
        temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE,
                                   description="Softmax temperature; 0 (or below 1e-5) = greedy decoding.",
                                   examples=[0.8])
        top_k: integer(ge=0, le=MAX_JSON_INTEGER) = Field(0, description="Keep the k most likely tokens; 0 = off.",
                                                          examples=[40])
        top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold; 1 = off.",
                             examples=[0.95])
        repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY, examples=[1.1],
                                          description="> 1 discourages tokens already present (prompt included), as "
                                          "in transformers.")
        no_repeat_ngram_size: NGramSize = Field(0, description="Forbid repeating any n-gram of this size, prompt "
                                                "included (every decoding mode, as transformers); 0 = off.",
                                                examples=[0])
        seed: Seed | None = Field(None, description="Same seed, same output.", examples=[7])
        stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS,
                                       description=f"Up to {MAX_STOP_STRINGS} stop strings of 1 to {MAX_STOP_CHARS} "
                                       "characters; the text is cut before the first one and finish_reason is "
                                       '"stop".', examples=[["\n\n"]])
        num_beams: Beams = Field(1, description="> 1: beam search instead of sampling.", examples=[1])
        stream: StrictBool = Field(False, description="Server-sent events, one per token (needs num_beams=1).",
                                   examples=[False])
        # the output constraint, at most one (`service.api.constraint_fields`); a value that does not compile: 400
        json_schema: dict[str, Any] | None = Field(
            None, description="The text is JSON matching this JSON schema (compact: no whitespace between tokens).",
            examples=[{"type": "object", "properties": {"mood": {"enum": ["merry", "sad"]}}, "required": ["mood"]}])
        regex: str | None = Field(None, description="The text matches this regular expression (all of it).",
                                  examples=["[A-Z][a-z]+ [a-z]+[.!]"])
        choice: list[str] | None = Field(None, description="The text is one of these strings.",
                                         examples=[["stay", "go"]])
        grammar: str | None = Field(None, description="The text matches this grammar (Lark, or llama.cpp's GBNF).",
                                    examples=['start: "Romeo is " ("merry" | "sad") "."'])
        model: Name | None = _model_field("gpt")
        version: Version | None = Field(None, description=version_doc, examples=[1])
        timeout_ms: Timeout | None = Field(None, description=timeout_doc, examples=[text_timeout])
        priority: QueueLevel | None = Field(None, description=priority_doc, examples=[1])

        def to_params(self, fields: str = "") -> GenerationParams:
            """The serving parameters of this request (the Open Inference Protocol's gpt options too: `fields`
            prefixes the name of the constraint's field in errors, "parameters.")."""
            constraint = one_constraint([(fields + name, kind, getattr(self, name))
                                         for name, kind in NATIVE_FIELDS.items() if getattr(self, name) is not None])
            return GenerationParams(
                max_new_tokens=self.max_new_tokens, min_new_tokens=self.min_new_tokens,
                temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                repetition_penalty=self.repetition_penalty, no_repeat_ngram_size=self.no_repeat_ngram_size,
                seed=self.seed, stop=tuple(self.stop), num_beams=self.num_beams, constraint=constraint,
                priority=self.priority)

    class ClassifyJSONRequest(_Strict):
        model_config = ConfigDict(json_schema_extra={"examples": [{"images": [EXAMPLE_PNG_BASE64], "top_k": 3}]})

        images: list[Annotated[str, Field(min_length=1, max_length=base64_chars(s.max_image_bytes))]] = Field(
            ..., min_length=1, max_length=s.max_images, description=f"Base64-encoded image files (PNG, JPEG, ...), "
            f"up to {s.max_images} (TSERVE_MAX_IMAGES) of up to {s.max_image_bytes} bytes "
            "(TSERVE_MAX_IMAGE_BYTES); a data URL prefix and line breaks are fine.",
            examples=[[EXAMPLE_PNG_BASE64]])
        top_k: integer(ge=1) = Field(DEFAULT_TOP_K_LABELS, description="Predictions per image, best first (every "
                                     "label if it has fewer).", examples=[3])
        model: Name | None = _model_field("vit")
        version: Version | None = Field(None, description=version_doc, examples=[1])
        timeout_ms: Timeout | None = Field(None, description=timeout_doc, examples=[image_timeout])
        priority: QueueLevel | None = Field(None, description=priority_doc, examples=[1])

    class ScoreRequest(_Strict):
        model_config = ConfigDict(json_schema_extra={"examples": [
            {"source": "Ein Mann fährt Fahrrad.", "target": ["A man is riding a bicycle.", "A man rides a bike."]}]})

        source: Text | Texts = Field(
            ..., description=f"German sentence, or a list of up to {s.max_texts} (TSERVE_MAX_TEXTS), one per target; "
            f"each up to {s.max_text_chars} characters, read as /v1/translate reads it.",
            examples=["Ein Mann fährt Fahrrad."])
        target: Text | Texts = Field(
            ..., description=f"English sentence to score, or a list of up to {s.max_texts}: scored against the one "
            "source, or pairwise against a list of as many sources (otherwise 400); a target longer than the "
            "model's positional table is a 400.", examples=[["A man is riding a bicycle.", "A man rides a bike."]])
        model: Name | None = _model_field("translation")
        version: Version | None = Field(None, description=version_doc, examples=[1])
        timeout_ms: Timeout | None = Field(None, description=timeout_doc, examples=[text_timeout])

    return RequestModels(TranslateRequest, GenerateRequest, ClassifyJSONRequest, ScoreRequest)


class Translation(BaseModel):
    text: str = Field(..., examples=["A man is riding a bicycle."])
    score: float = Field(..., description="Beam score (length-normalised), or the sum of log-probs when greedy; of "
                         "the generated tokens only: a target_prefix's are forced and not counted.")


class TranslateResponse(BaseModel):
    model: str
    version: int
    translations: list[list[Translation]] = Field(..., description="One n-best list per input text.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class GenerateResponse(BaseModel):
    model: str
    version: int
    text: str = Field(..., examples=["What say you?"])
    finish_reason: Literal["eos", "length", "stop"]
    usage: Usage


class TargetScore(BaseModel):
    tokens: list[str] = Field(..., description="The target's tokens (the tokenizer's pieces), end of sentence last.",
                              examples=[["▁A", "▁man", "▁is", "▁riding", "▁a", "▁bicycle.", "</s>"]])
    token_ids: list[int]
    logprobs: list[float] = Field(..., description="Each token's log-probability given the source and the tokens "
                                  "before it (natural log), the end of sentence's included.")
    score: float = Field(..., description="The sum of `logprobs`: the target's log-probability (greedy "
                         "/v1/translate's score of the same output).")
    mean_logprob: float = Field(..., description="`score` / number of tokens (end of sentence included), as "
                                "CTranslate2's normalized_score.")


class ScoreResponse(BaseModel):
    model: str
    version: int
    scores: list[TargetScore] = Field(..., description="One per target, in order.")
    usage: Usage = Field(..., description="prompt_tokens: the source tokens encoded (a source shared by several "
                         "targets counted once); completion_tokens: the target tokens scored.")


class Prediction(BaseModel):
    label: str = Field(..., examples=["Ankle boot"])
    index: int
    score: float = Field(..., description="Softmax probability.")


class ClassifyResponse(BaseModel):
    model: str
    version: int
    predictions: list[list[Prediction]] = Field(..., description="Top-k predictions per image, best first.")


class Liveness(BaseModel):
    status: Literal["live"]


class Readiness(BaseModel):
    status: Literal["ready", "not ready"]
    reasons: list[str] = Field([], description="Why the server is not ready (models loading or failed, draining), "
                               "and what a ready server serves without (the response cache's Redis down).")


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail
