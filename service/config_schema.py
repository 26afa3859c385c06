"""The schema of a model version's `config.json`, one per kind (`SCHEMAS`), checked when the repository reads the
version (`service.repository.read_config`): every field the serving side reads, strictly typed and ranged (pydantic's
strict mode: no `"257"` for 257, no `true` for 1, no `null` for an optional field), so that a config the exporter did
not write (edited by hand, cut, another kind's) is skipped at start-up and refused by model control naming the file
and the field (`config.json: files.decoder: Field required`), never a KeyError or a TypeError deep in an engine.

What `python -m export` and `export.convert` write besides (the run's name, dates, `variants`' measurements, the
card's notes) stays free, as in Hugging Face's `config.json`: unknown keys are allowed, except in `files`, whose
every entry is a graph the version is loaded, hashed (`service.models.calibration`) and rewritten from.

Invariant: every field an engine reads from a valid config is there, of its type, in its range (the length penalty's
bound, what a request may ask for, is warm-up's), and every file it names is a plain name inside its version folder.
It sits below the serving layers: of the service it imports `errors` only.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from service.errors import describe_validation

# The kinds a version's config.json may name (what each kind is, its engine, scheduler and warm-up:
# `service.models.kinds`; `service.repository` re-exports them, which the engines' modules import).
TRANSLATION, GPT, VIT = "translation", "gpt", "vit"
KINDS = (TRANSLATION, GPT, VIT)
# How a version's graphs compute, as its config.json says (`export.repository.rewrite_graphs` writes these keys; a
# config without them is a plain float32 export): stored weights (fp16 is a storage: it computes in float32),
# attention, and for the text kinds the KV cache (inplace: a step graph writing the new slot into fixed buffers).
VARIANT_DEFAULTS = {"weights": "fp32", "attention": "plain", "kv_cache": "concat"}
VARIANT_VALUES = {"weights": ("fp32", "fp16", "int8"), "attention": ("plain", "mha"), "kv_cache": ("concat", "inplace")}
# Every size and token id fits an int32: tokenizers' ids are u32, and the engines bind them in int64 tensors.
MAX_INT32 = 2**31 - 1
# A graph's file name: a plain name in the version folder (no `/`, no `..`, not hidden), at most a file system's.
FILE_NAME_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
MAX_FILE_NAME_CHARS = 255
IMAGE_CHANNELS = (1, 3)  # greyscale ("L") or RGB: what the ViT engine converts an image to
# A reason names at most this many invalid fields (and how many more), in at most this many characters: a config
# with a million bad labels is refused in one readable line.
MAX_REPORTED_ERRORS = 5
MAX_REASON_CHARS = 1000

Count = Annotated[int, Field(strict=True, gt=0, le=MAX_INT32)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_INT32)]
Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]
OPEN = ConfigDict(strict=True, extra="allow")  # an object whose other keys the serving side does not read
# A field written `name: T = None` may be absent (the engines then use their default) but never `null`: pydantic
# does not validate a default, and strict mode refuses None for T.


class Files(BaseModel):
    """The version's graphs by role (a kind's roles: its subclass's fields), each a plain file name."""

    model_config = ConfigDict(strict=True, extra="allow")  # unknown roles refused by `_known_roles`, naming them
    kind: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _known_roles(cls, files: Any) -> Any:
        unknown = [key for key in files if key not in cls.model_fields] if isinstance(files, dict) else []
        if unknown:
            raise PydanticCustomError("unknown_graph", "{unknown}: a {kind} version has no such graph (its graphs: "
                                      "{known})", {"unknown": repr(unknown[0])[:MAX_FILE_NAME_CHARS],
                                                   "kind": cls.kind, "known": ", ".join(cls.model_fields)})
        return files

    @field_validator("*")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if not (len(name) <= MAX_FILE_NAME_CHARS and FILE_NAME_PATTERN.fullmatch(name)):
            raise PydanticCustomError("file_name", "must be a plain file name in the version folder (letters, "
                                      "digits, '_', '.' and '-', not starting with '.', at most {most} characters)",
                                      {"most": MAX_FILE_NAME_CHARS})
        return name


class TranslationFiles(Files):
    """The encoder, and the decoder, its in-place step graph (`export.kv_inplace`) or both."""

    kind = TRANSLATION
    encoder: str
    decoder: str = None
    decoder_step: str = None

    @model_validator(mode="after")
    def _a_decoder(self) -> TranslationFiles:
        if not (self.decoder or self.decoder_step):
            raise PydanticCustomError("no_decoder", "names no decoder graph (decoder or decoder_step)")
        return self


class GPTFiles(Files):
    """The decoder (the prompt pass, and the steps unless there is an in-place step graph)."""

    kind = GPT
    decoder: str
    decoder_step: str = None


class ViTFiles(Files):
    kind = VIT
    model: str


class TextArchitecture(BaseModel):
    """What a text engine binds its cache and logits with (`vocab_size`: the width of the graphs' logits)."""

    model_config = OPEN
    vocab_size: Count
    n_heads: Count
    head_dim: Count


class GPTArchitecture(TextArchitecture):
    n_layers: Count


class TranslationArchitecture(TextArchitecture):
    n_decoder_layers: Count


class GPTSpecialTokens(BaseModel):
    model_config = OPEN
    eos_id: TokenId


class TranslationSpecialTokens(GPTSpecialTokens):
    pad_id: TokenId
    bos_id: TokenId


class Generation(BaseModel):
    """The translator's served defaults, chosen on validation (the range a request may ask for: warm-up's check)."""

    model_config = OPEN
    length_penalty: Finite = None


class Image(BaseModel):
    """How the ViT preprocesses an image: converted to `channels`, resized to `size`, then (x / 255 - mean) / std."""

    model_config = OPEN
    size: Count
    channels: Annotated[int, Field(strict=True)]
    mean: Finite
    std: Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]

    @field_validator("channels")
    @classmethod
    def _channels(cls, channels: int) -> int:
        if channels not in IMAGE_CHANNELS:
            raise PydanticCustomError("channels", "must be 1 (greyscale) or 3 (RGB)")
        return channels


class ResponseCacheConfig(BaseModel):
    """Triton's `response_cache { enable: true }`: the response cache on for this version (`service.response_cache`)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    enable: bool


class VersionConfig(BaseModel):
    """What every kind's config may say: how its graphs compute, the variants checked at export, and whether the
    response cache is on for it."""

    model_config = OPEN
    weights: str = None
    attention: str = None
    kv_cache: str = None
    variants: dict[str, dict[str, Any]] | None = None  # variant -> its quality check (`service.models.variants`)
    response_cache: ResponseCacheConfig = None

    @field_validator(*VARIANT_VALUES)
    @classmethod
    def _variant(cls, value: str, info: ValidationInfo) -> str:
        allowed = VARIANT_VALUES[info.field_name]
        if value not in allowed:
            raise PydanticCustomError("one_of", "must be one of {allowed}", {"allowed": ", ".join(allowed)})
        return value


class TextConfig(VersionConfig):
    """A text kind's: its graphs, their architecture, then the special ids (checked against the vocabulary)."""

    files: Files
    architecture: TextArchitecture
    special_tokens: GPTSpecialTokens

    @field_validator("special_tokens")
    @classmethod
    def _ids_in_vocabulary(cls, special: GPTSpecialTokens, info: ValidationInfo) -> GPTSpecialTokens:
        architecture = info.data.get("architecture")  # validated before, when valid
        for name in type(special).model_fields:
            token_id = getattr(special, name)
            if architecture is not None and token_id >= architecture.vocab_size:
                raise PydanticCustomError("special_id", "{name} {id} is not below architecture.vocab_size {size}",
                                          {"name": name, "id": token_id, "size": architecture.vocab_size})
        return special


class GPTConfig(TextConfig):
    files: GPTFiles
    architecture: GPTArchitecture
    special_tokens: GPTSpecialTokens
    context_length: Count


class TranslationConfig(TextConfig):
    files: TranslationFiles
    architecture: TranslationArchitecture
    special_tokens: TranslationSpecialTokens
    max_source_length: Count
    max_target_length: Count
    generation: Generation = None


class ViTConfig(VersionConfig):
    files: ViTFiles
    image: Image
    labels: Annotated[list[str], Field(strict=True, min_length=1)]


SCHEMAS: dict[str, type[VersionConfig]] = {TRANSLATION: TranslationConfig, GPT: GPTConfig, VIT: ViTConfig}


def config_problems(kind: str, config: dict[str, Any]) -> str | None:
    """Why `config` (a JSON object naming `kind`, one of `KINDS`) is not a valid config of its kind: its invalid
    fields, each with what is wrong (`files.decoder: Field required`); None when it is valid."""
    try:
        SCHEMAS[kind].model_validate(config)
    except ValidationError as error:
        errors = error.errors(include_url=False, include_input=False)
        reason = describe_validation(errors[:MAX_REPORTED_ERRORS])
        if len(errors) > MAX_REPORTED_ERRORS:
            reason += f" (and {len(errors) - MAX_REPORTED_ERRORS} more)"
        return reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS] + "..."
    return None
