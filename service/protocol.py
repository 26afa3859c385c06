"""Request and response schemas of the HTTP API (pydantic), with the examples the OpenAPI page shows.

Static ranges are checked here (unknown fields and out-of-range values are 422); limits that are settings
(text length, new tokens, image counts) are checked by the routes against the running configuration.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class _Routing(_Strict):
    model: str | None = Field(None, description="Model name in the repository; default: the kind's default model.",
                              examples=["translation"])
    version: int | None = Field(None, ge=1, description="Model version; default: the highest loaded version.",
                                examples=[1])
    timeout_ms: int | None = Field(None, ge=1, description="Deadline for queueing + decoding, in milliseconds; "
                                   "default and maximum are server settings. Past it: 504.", examples=[10000])


class TranslateRequest(_Routing):
    model_config = ConfigDict(json_schema_extra={"examples": [{"text": "Ein Mann fährt Fahrrad.", "num_beams": 4}]})

    text: str | list[str] = Field(..., description="German sentence, or a list of up to 32 sentences.",
                                  examples=["Ein Mann fährt Fahrrad."])
    num_beams: int = Field(4, ge=1, le=32, description="Beam width; 1 = greedy decoding.", examples=[4])
    length_penalty: float = Field(1.0, ge=-5.0, le=5.0,
                                  description="Beam score = sum of log-probs / generated_length ** length_penalty.",
                                  examples=[1.0])
    early_stopping: bool | Literal["never"] = Field(False, description="Beam stopping rule, as in transformers: "
                                                    "true, false or \"never\".", examples=[False])
    num_return_sequences: int = Field(1, ge=1, description="Size of the n-best list per sentence (<= num_beams).",
                                      examples=[1])
    max_new_tokens: int | None = Field(None, ge=1, description="Most tokens to generate per sentence; default: "
                                       "twice the source length + 10.", examples=[40])
    min_new_tokens: int = Field(0, ge=0, description="End of sentence is blocked before this many tokens.",
                                examples=[0])
    no_repeat_ngram_size: int = Field(0, ge=0, le=10, description="Forbid repeating any n-gram of this size; 0 = off.",
                                      examples=[0])
    stream: bool = Field(False, description="Server-sent events, one per token (greedy: num_beams=1, one text).",
                         examples=[False])

    @model_validator(mode="after")
    def _consistent(self) -> TranslateRequest:
        if self.num_return_sequences > self.num_beams:
            raise ValueError("num_return_sequences must be <= num_beams")
        if self.stream and (self.num_beams != 1 or isinstance(self.text, list)):
            raise ValueError("stream=true needs num_beams=1 and a single text")
        return self


class Translation(BaseModel):
    text: str = Field(..., examples=["A man is riding a bicycle."])
    score: float = Field(..., description="Beam score (length-normalised), or the sum of log-probs when greedy.")


class TranslateResponse(BaseModel):
    model: str
    version: int
    translations: list[list[Translation]] = Field(..., description="One n-best list per input text.")


class GenerateRequest(_Routing):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "ROMEO:\n", "max_new_tokens": 80, "temperature": 0.8, "top_k": 40, "seed": 7}]})

    prompt: str = Field(..., min_length=1, description="Text to continue.", examples=["ROMEO:\n"])
    max_new_tokens: int = Field(64, ge=1, description="Most tokens (bytes) to generate.", examples=[80])
    min_new_tokens: int = Field(0, ge=0, description="End of text is blocked before this many tokens.",
                                examples=[0])
    temperature: float = Field(1.0, ge=0.0, le=5.0, description="Softmax temperature; 0 = greedy decoding.",
                               examples=[0.8])
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.", examples=[40])
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold; 1 = off.", examples=[0.95])
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="> 1 discourages tokens already present "
                                      "(prompt included), as in transformers.", examples=[1.1])
    seed: int | None = Field(None, ge=0, description="Same seed, same output.", examples=[7])
    stop: list[str] = Field(default_factory=list, max_length=8, description="Up to 8 stop strings; the text is cut "
                            "before the first one and finish_reason is \"stop\".", examples=[["\n\n"]])
    num_beams: int = Field(1, ge=1, le=32, description="> 1: beam search instead of sampling.", examples=[1])
    stream: bool = Field(False, description="Server-sent events, one per token.", examples=[False])

    @field_validator("stop")
    @classmethod
    def _stops(cls, stops: list[str]) -> list[str]:
        if any(not s or len(s) > 64 for s in stops):
            raise ValueError("each stop string must have 1 to 64 characters")
        return stops

    @model_validator(mode="after")
    def _consistent(self) -> GenerateRequest:
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError("min_new_tokens must be <= max_new_tokens")
        if self.stream and self.num_beams > 1:
            raise ValueError("stream=true needs num_beams=1")
        return self

    @property
    def mode(self) -> str:
        return "beam" if self.num_beams > 1 else "greedy" if self.temperature == 0 else "sample"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class GenerateResponse(BaseModel):
    model: str
    version: int
    text: str = Field(..., examples=["What say you?"])
    finish_reason: Literal["eos", "length", "stop"]
    usage: Usage


class ClassifyJSONRequest(_Strict):
    model_config = ConfigDict(json_schema_extra={"examples": [{"images": ["iVBORw0KGgoAAAANSUhEUgAA..."],
                                                               "top_k": 3}]})

    images: list[str] = Field(..., min_length=1, description="Base64-encoded image files (PNG, JPEG, ...), up to 64.",
                              examples=[["iVBORw0KGgoAAAANSUhEUgAA..."]])
    top_k: int = Field(5, ge=1, description="Predictions per image, best first.", examples=[3])
    model: str | None = Field(None, description="Model name; default: vit.", examples=["vit"])
    version: int | None = Field(None, ge=1, description="Model version; default: the highest loaded.", examples=[1])
    timeout_ms: int | None = Field(None, ge=1, description="Deadline in milliseconds (default: server setting).",
                                   examples=[5000])


class Prediction(BaseModel):
    label: str = Field(..., examples=["Ankle boot"])
    index: int
    score: float = Field(..., description="Softmax probability.")


class ClassifyResponse(BaseModel):
    model: str
    version: int
    predictions: list[list[Prediction]] = Field(..., description="Top-k predictions per image, best first.")


class ModelStatus(BaseModel):
    name: str
    kind: str
    versions: list[int] = Field(..., description="Versions present in the repository.")
    active_version: int | None = Field(..., description="The version served when a request names none.")
    loaded_versions: list[int]
    provider: str | None
    ready: bool


class ModelsResponse(BaseModel):
    models: list[ModelStatus]


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail
