"""Request and response schemas of the HTTP API (pydantic), with the examples the OpenAPI page shows.

The schema is the contract: every limit a request must keep is in it. The request models are built per app by
`request_models(settings)`, so the limits that are settings (text length, number of texts, new tokens, beams,
images, deadline) appear in `/openapi.json` as maxLength / maxItems / maximum and are enforced by the same
validation; anything that does not conform is a 422 naming the field. Validation is strict (`"stream": 0` is not a
boolean, `"4"` is not an integer) and every string must be valid Unicode: a lone surrogate (which JSON can carry as
an escape, and no UTF-8 can) in any string or field name is a 422 naming where it is, before any field is read
(`ValidUnicode`, shared by the OpenAI-compatible and Open Inference Protocol requests). What a schema cannot express
is checked by the routes and answered 400 with the reason: a prompt whose tokens plus `max_new_tokens` exceed the
model's context, `num_return_sequences` above `num_beams`, `min_new_tokens` above `max_new_tokens`, an image that
does not decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from service.settings import Settings

MAX_NAME_CHARS = 128  # model names
MAX_STOP_STRINGS, MAX_STOP_CHARS = 8, 64
MAX_NGRAM_SIZE = 10
MAX_LENGTH_PENALTY = 5.0
MAX_TEMPERATURE = 5.0
MAX_REPETITION_PENALTY = 10.0
MAX_SEED = 2**53 - 1  # the largest integer every JSON parser reads exactly
NON_BLANK = r"\S"  # a JSON-schema pattern (unanchored): at least one character that is not whitespace
# A base64 image of n bytes is 4 * ceil(n / 3) characters; allow line breaks every 76 (as `base64` wraps) and a
# `data:image/...;base64,` prefix on top.
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
    chars = 4 * -(-max_bytes // 3)
    return chars + chars // BASE64_LINE + DATA_URL_PREFIX_CHARS


def ascii_digits(text: str) -> bool:
    """Whether `text` is a non-negative decimal integer in ASCII digits: `str.isdigit()` also holds for "²" (which
    `int()` refuses) and for other scripts' digits, which a number in a header or a path must not be."""
    return text.isascii() and text.isdigit()


def _surrogate_in(text: str) -> str | None:
    """The first lone surrogate of `text` (what UTF-8 cannot hold), or None; ASCII, the common case, costs nothing."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return text[error.start]
    return None


_SCALARS = frozenset({int, float, bool, type(None)})  # the JSON values that hold no string


def lone_surrogate(data) -> tuple[tuple, str | None, str] | None:
    """The first lone surrogate in parsed JSON, in document order: (its location, the field name that holds it or
    None when a value does, the surrogate), or None when every string and field name is valid Unicode. Iterative,
    so that nesting as deep as the JSON parser allows is no problem here."""
    stack = [((), data)]
    while stack:
        location, value = stack.pop()
        if isinstance(value, str):
            if (surrogate := _surrogate_in(value)) is not None:
                return location, None, surrogate
        elif isinstance(value, dict):
            for key in value:
                if isinstance(key, str) and (surrogate := _surrogate_in(key)) is not None:
                    return location, key, surrogate
            stack.extend(((*location, key), item) for key, item in reversed(value.items()))
        elif isinstance(value, list) and not _SCALARS.issuperset(map(type, value)):  # a list of numbers: skipped
            for index in range(len(value) - 1, -1, -1):
                if isinstance(value[index], (str, dict, list)):
                    stack.append(((*location, index), value[index]))
    return None


class ValidUnicode(BaseModel):
    """A request model whose every string and field name must be valid Unicode, checked on the raw input before any
    field (a string that reached an unconstrained field would otherwise fail later, in a tokenizer or in rendering
    a response): otherwise a validation error located where the lone surrogate is."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        if (found := lone_surrogate(data)) is not None:
            location, key, surrogate = found
            escaped = surrogate.encode("utf-8", "backslashreplace").decode()
            message = (f"{'a field name' if key is not None else 'Input'} should be a valid unicode string: it holds "
                       f"the lone surrogate {escaped} (half of a UTF-16 pair)")
            raise ValidationError.from_exception_data(cls.__name__, [InitErrorDetails(
                type=PydanticCustomError("string_unicode", message), loc=location, input=escaped)])
        return data


class _Strict(ValidUnicode):
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())


def _integral(value):
    """JSON Schema counts 7.0 as an integer; strict pydantic does not. Accept integral floats (only)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds):
    """An integer field type with its bounds (ge, le): 7.0 is accepted as 7; "7", 7.5 and true are not integers."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


def _model_field(default: str):
    return Field(None, description=f"Model name in the repository; default: {default}.", examples=[default])


@dataclass(frozen=True)
class RequestModels:
    """One app's request models, with its settings' limits in them."""

    translate: type[BaseModel]
    generate: type[BaseModel]
    classify: type[BaseModel]


def request_models(settings: Settings) -> RequestModels:
    """The request models of an app served with `settings` (limits as maxLength / maxItems / maximum)."""
    s = settings
    Text = Annotated[str, Field(min_length=1, max_length=s.max_text_chars, pattern=NON_BLANK)]
    NewTokens, Beams = integer(ge=1, le=s.max_new_tokens), integer(ge=1, le=s.max_num_beams)
    MinNewTokens, NGramSize = integer(ge=0, le=s.max_new_tokens), integer(ge=0, le=MAX_NGRAM_SIZE)
    Version, Timeout = integer(ge=1), integer(ge=1, le=s.max_timeout_ms)
    timeout_doc = (f"Deadline for queueing + decoding, in milliseconds; default {s.default_timeout_ms} "
                   f"(TSERVE_DEFAULT_TIMEOUT_MS), at most {s.max_timeout_ms} (TSERVE_MAX_TIMEOUT_MS). Past it: 504.")
    version_doc = "Model version; default: the highest loaded version."
    some_new_tokens = min(40, s.max_new_tokens)  # the examples must be valid requests

    class TranslateRequest(_Strict):
        model_config = ConfigDict(json_schema_extra={
            "examples": [{"text": "Ein Mann fährt Fahrrad.", "num_beams": min(4, s.max_num_beams)}],
            # stream=true needs greedy decoding of a single text
            "if": {"properties": {"stream": {"const": True}}, "required": ["stream"]},
            "then": {"properties": {"num_beams": {"const": 1}, "text": {"type": "string"}},
                     "required": ["num_beams"]}})

        text: Text | Annotated[list[Text], Field(min_length=1, max_length=s.max_texts)] = Field(
            ..., description=f"German sentence, or a list of up to {s.max_texts} sentences (TSERVE_MAX_TEXTS), each "
            f"up to {s.max_text_chars} characters (TSERVE_MAX_TEXT_CHARS).", examples=["Ein Mann fährt Fahrrad."])
        num_beams: Beams = Field(min(4, s.max_num_beams), description="Beam width; 1 = greedy decoding.",
                                 examples=[min(4, s.max_num_beams)])
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
        stream: StrictBool = Field(False, description="Server-sent events, one per token (needs num_beams=1 and one "
                                   "text).", examples=[False])
        model: Name | None = _model_field("translation")
        version: Version | None = Field(None, description=version_doc, examples=[1])
        timeout_ms: Timeout | None = Field(None, description=timeout_doc, examples=[min(10_000, s.max_timeout_ms)])

    class GenerateRequest(_Strict):
        model_config = ConfigDict(json_schema_extra={
            "examples": [{"prompt": "ROMEO:\n", "max_new_tokens": some_new_tokens, "temperature": 0.8, "top_k": 40,
                          "seed": 7}],
            "if": {"properties": {"stream": {"const": True}}, "required": ["stream"]},  # streaming is not for beams
            "then": {"properties": {"num_beams": {"const": 1}}}})

        prompt: str = Field(..., min_length=1, max_length=s.max_text_chars, description="Text to continue (up to "
                            f"{s.max_text_chars} characters, TSERVE_MAX_TEXT_CHARS; its tokens plus max_new_tokens "
                            "must fit the model's context, else 400).", examples=["ROMEO:\n"])
        max_new_tokens: NewTokens = Field(min(64, s.max_new_tokens), description="Most tokens (bytes) to generate.",
                                          examples=[some_new_tokens])
        min_new_tokens: MinNewTokens = Field(0, description="End of text is blocked before this many tokens (at "
                                             "most max_new_tokens; more is a 400).", examples=[0])
        temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE,
                                   description="Softmax temperature; 0 (or below 1e-5) = greedy decoding.",
                                   examples=[0.8])
        top_k: integer(ge=0) = Field(0, description="Keep the k most likely tokens; 0 = off.", examples=[40])
        top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold; 1 = off.",
                             examples=[0.95])
        repetition_penalty: float = Field(1.0, gt=0.0, le=MAX_REPETITION_PENALTY, examples=[1.1],
                                          description="> 1 discourages tokens already present (prompt included), as "
                                          "in transformers.")
        no_repeat_ngram_size: NGramSize = Field(0, description="Forbid repeating any n-gram of this size, prompt "
                                                "included (every decoding mode, as transformers); 0 = off.",
                                                examples=[0])
        seed: integer(ge=0, le=MAX_SEED) | None = Field(None, description="Same seed, same output.", examples=[7])
        stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS,
                                       description=f"Up to {MAX_STOP_STRINGS} stop strings of 1 to {MAX_STOP_CHARS} "
                                       "characters; the text is cut before the first one and finish_reason is "
                                       '"stop".', examples=[["\n\n"]])
        num_beams: Beams = Field(1, description="> 1: beam search instead of sampling.", examples=[1])
        stream: StrictBool = Field(False, description="Server-sent events, one per token (needs num_beams=1).",
                                   examples=[False])
        model: Name | None = _model_field("gpt")
        version: Version | None = Field(None, description=version_doc, examples=[1])
        timeout_ms: Timeout | None = Field(None, description=timeout_doc, examples=[min(10_000, s.max_timeout_ms)])

        @property
        def mode(self) -> str:
            return "beam" if self.num_beams > 1 else "greedy" if self.temperature == 0 else "sample"

    class ClassifyJSONRequest(_Strict):
        model_config = ConfigDict(json_schema_extra={"examples": [{"images": [EXAMPLE_PNG_BASE64], "top_k": 3}]})

        images: list[Annotated[str, Field(min_length=1, max_length=base64_chars(s.max_image_bytes))]] = Field(
            ..., min_length=1, max_length=s.max_images, description=f"Base64-encoded image files (PNG, JPEG, ...), "
            f"up to {s.max_images} (TSERVE_MAX_IMAGES) of up to {s.max_image_bytes} bytes "
            "(TSERVE_MAX_IMAGE_BYTES); a data URL prefix and line breaks are fine.",
            examples=[[EXAMPLE_PNG_BASE64]])
        top_k: integer(ge=1) = Field(5, description="Predictions per image, best first (every label if it has "
                                     "fewer).", examples=[3])
        model: Name | None = _model_field("vit")
        version: Version | None = Field(None, description=version_doc, examples=[1])
        timeout_ms: Timeout | None = Field(None, description=timeout_doc, examples=[min(5_000, s.max_timeout_ms)])

    return RequestModels(TranslateRequest, GenerateRequest, ClassifyJSONRequest)


class Translation(BaseModel):
    text: str = Field(..., examples=["A man is riding a bicycle."])
    score: float = Field(..., description="Beam score (length-normalised), or the sum of log-probs when greedy.")


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
    reasons: list[str] = Field([], description="Why the server is not ready (models loading or failed, draining).")


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail
