"""`POST /v1/classify`: image classification with the ViT, as a thin route (vLLM's entrypoint layout):
parse the body -> validate against the settings -> decode and preprocess off the event loop -> submit to the
model's `DynamicBatcher` -> await the logits within the deadline -> top-k softmax predictions.

Two request shapes are accepted (like Triton's and TorchServe's HTTP frontends):
- `multipart/form-data`: one or more `files` parts (any image Pillow reads, any size or mode) and optional
  `top_k`, `model`, `version`, `timeout_ms`, `priority` fields;
- `application/json`: the `ClassifyJSONRequest` model, images as base64 strings (a `data:image/...;base64,` prefix
  is fine).

Bad input is never a 500: 415 for another content type, 422 for invalid fields, 413 for too many / too large
images (the pixel count is read from the header before any pixel is decoded), 400 naming the image that could
not be decoded.
"""

from __future__ import annotations

import json
import time
from functools import cache

import numpy as np
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from service.decoding import top_k_indices
from service.errors import (
    BadInput,
    PayloadTooLarge,
    UnsupportedMediaType,
    json_error_reason,
)
from service.api.native.protocol import ClassifyResponse, ErrorResponse, Prediction, RequestModels
from service.engines.imaging import EncodedImage
from service.http.apis import NATIVE
from service.http.errors import ClientBodyError, media_type
from service.repository import VIT
from service.serving import classify as classification
from service.serving.context import label, resolve
from service.settings import Settings

ACCEPTED_TYPES = ("multipart/form-data", "application/json")
FORM_FIELDS = ("top_k", "model", "version", "timeout_ms", "priority")
MAX_FORM_FIELDS = 32  # plain fields a multipart body may hold (Starlette's parser stops beyond)
MS_PER_SECOND = 1000  # `timeout_ms` is in milliseconds; the deadline, from the body's arrival, in seconds


@cache
def _form_options(json_model: type[BaseModel]) -> type[BaseModel]:
    """The multipart fields' model: the JSON body's rules, without `images` (they come as `files` parts) and lax,
    since form fields arrive as text ("3" is a top_k there)."""

    class ClassifyFormOptions(json_model):
        model_config = ConfigDict(strict=False)
        images: list[str] = []

    return ClassifyFormOptions


# --- OpenAPI ------------------------------------------------------------------------------------------------


def _multipart_schema(json_schema: dict, settings: Settings) -> dict:
    """The multipart body: `files` parts plus the JSON body's option fields, with the same limits."""
    return {"type": "object", "required": ["files"], "additionalProperties": False, "properties": {
        "files": {"type": "array", "minItems": 1, "maxItems": settings.max_images,
                  "description": f"One part per image, up to {settings.max_images} (TSERVE_MAX_IMAGES), each up to "
                  f"{settings.max_image_bytes} bytes (TSERVE_MAX_IMAGE_BYTES): PNG, JPEG, WebP, BMP, GIF, TIFF, ...; "
                  "any size or mode: images are converted, resized and normalised as the model's config says.",
                  "items": {"type": "string", "format": "binary", "contentMediaType": "application/octet-stream"}},
        **{name: _form_field(json_schema["properties"][name]) for name in FORM_FIELDS}}}


def _form_field(schema: dict) -> dict:
    """A JSON body field as a form field: an optional field is left out rather than sent as null."""
    members = [m for m in schema.get("anyOf", []) if m.get("type") != "null"]
    if len(members) != 1:
        return schema
    rest = {k: v for k, v in schema.items() if k not in ("anyOf", "default")}
    return {**members[0], **rest}


def _error(description: str, **extra) -> dict:
    return {"model": ErrorResponse, "description": description, **extra}


_RESPONSES = {
    400: _error("An image could not be decoded or is not valid base64 (the message names which), or a malformed "
                "multipart body."),
    404: _error("Unknown model or version, or a model that is not an image model."),
    408: _error("The body did not arrive within TSERVE_BODY_TIMEOUT_S."),
    413: _error("An image over TSERVE_MAX_IMAGE_BYTES or over TSERVE_MAX_IMAGE_PIXELS pixels, images together over "
                "TSERVE_MAX_REQUEST_PIXELS pixels or over TSERVE_IMAGE_DECODE_BUDGET_BYTES decoded, or a body over "
                "TSERVE_MAX_BODY_BYTES."),
    415: _error("Content-Type is neither multipart/form-data nor application/json."),
    422: _error("The body does not conform to the schema: no images or too many (TSERVE_MAX_IMAGES), an unknown or "
                "invalid field, invalid JSON; the message names the field."),
    429: _error("The model's queue is full.", headers={"Retry-After": {
        "description": "Seconds after which the queue is expected to have room (at most the request's deadline).",
        "schema": {"type": "integer"}}}),
    503: _error("The model is not loaded yet, or the server is shutting down."),
    504: _error("The deadline (timeout_ms) passed before the images were classified."),
}

_DESCRIPTION = """Classify one or more images; returns the `top_k` most likely labels per image, in request order,
with softmax probabilities.

Send either **multipart/form-data** (one `files` part per image, plus optional `top_k`, `model`, `version`,
`timeout_ms`, `priority` fields), e.g. `curl -F files=@shoe.png -F files=@shirt.jpg -F top_k=3 .../v1/classify`, or
**application/json** with base64-encoded image files: `{"images": ["iVBORw0...", ...], "top_k": 3}`.

Any image Pillow reads is accepted, in any size or mode: it is converted to the model's mode (transparent pixels
on white), resized and normalised as the model's config says. Requests are batched with other requests for the
same model (dynamic batching: up to TSERVE_VIT_MAX_BATCH_SIZE images, waiting at most
TSERVE_VIT_MAX_QUEUE_DELAY_MS for a batch to fill)."""


def build_router(models: RequestModels, settings: Settings) -> APIRouter:
    """The classify route, its two body types documented with this app's limits."""
    json_schema = models.classify.model_json_schema(ref_template="#/components/schemas/{model}")
    router = APIRouter(tags=["images"], route_class=NATIVE.route_class)
    router.add_api_route(
        "/v1/classify", classify, methods=["POST"], response_model=ClassifyResponse, summary="Classify images (ViT)",
        description=_DESCRIPTION, responses=_RESPONSES,
        openapi_extra={"requestBody": {"required": True, "content": {
            "multipart/form-data": {"schema": _multipart_schema(json_schema, settings),
                                    "encoding": {"files": {"contentType": "image/*"}}},
            "application/json": {"schema": json_schema},
        }}})
    return router


# --- the route ----------------------------------------------------------------------------------------------


async def classify(request: Request) -> ClassifyResponse:
    received = time.monotonic()
    request.state.mode = "classify"
    settings: Settings = request.app.state.settings
    options, encoded = await _parse(request, settings)
    deadline = received + (options.timeout_ms or settings.default_timeout_ms) / MS_PER_SECOND
    loaded = resolve(request, VIT, options.model, options.version)
    label(request, loaded, "classify")
    probabilities = await classification.classify(request, loaded, encoded, deadline,
                                                  options.priority)  # (n, classes)
    return ClassifyResponse(model=loaded.name, version=loaded.version,
                            predictions=_top_k(probabilities, loaded.engine.labels, options.top_k))


def _top_k(probabilities: np.ndarray, labels: list[str], k: int) -> list[list[Prediction]]:
    """The k most likely labels per row of probabilities (n, classes), best first (every label if fewer)."""
    top = top_k_indices(probabilities, k)
    return [[Prediction(label=labels[i], index=int(i), score=float(p[i])) for i in row]
            for p, row in zip(probabilities, top)]


# --- parsing ------------------------------------------------------------------------------------------------


def _invalid(field: str, message: str):
    """Raise a 422 in the same shape as every other validation error of the API."""
    raise RequestValidationError([{"type": "value_error", "loc": ("body", field), "msg": message}])


def _invalid_model(error: ValidationError):
    raise RequestValidationError(error.errors(include_url=False, include_context=False))


async def _parse(request: Request, settings: Settings) -> tuple[BaseModel, list[EncodedImage]]:
    media = media_type(request)
    if media == "application/json":
        return await _parse_json(request, settings)
    if media == "multipart/form-data":
        return await _parse_multipart(request, settings)
    raise UnsupportedMediaType(f"Content-Type {media or '(none)'!r} is not supported; send "
                               f"{' or '.join(ACCEPTED_TYPES)}")


async def _parse_json(request: Request, settings: Settings) -> tuple[BaseModel, list[EncodedImage]]:
    body = await request.body()
    if len(body) > settings.max_body_bytes:
        raise PayloadTooLarge(f"the body has {len(body)} bytes; the limit is {settings.max_body_bytes}")
    try:  # Python's JSON parser, as FastAPI's for the text routes: a lone surrogate is then the field's error
        data = json.loads(body)
    except (ValueError, RecursionError) as error:
        _invalid("body", f"not valid JSON ({json_error_reason(error)})")
    try:
        options = request.app.state.request_models.classify.model_validate(data)
    except ValidationError as error:
        _invalid_model(error)
    return options, [EncodedImage(f"images[{i}]", text) for i, text in enumerate(options.images)]


async def _parse_multipart(request: Request, settings: Settings) -> tuple[BaseModel, list[EncodedImage]]:
    try:
        # one file more than allowed, so that too many files is answered by the schema's rule (422), not the parser
        async with request.form(max_files=settings.max_images + 1, max_fields=MAX_FORM_FIELDS) as form:
            files, fields = [], {}
            for key, value in form.multi_items():
                if key == "files":
                    files.append(value)
                elif key in FORM_FIELDS and not isinstance(value, UploadFile):
                    if key in fields:
                        _invalid(key, "given more than once")
                    fields[key] = value  # as the schema says: an empty field is not a value
                else:
                    _invalid(key, f"unknown or misplaced form field; send images as 'files' parts and "
                                  f"{', '.join(FORM_FIELDS)} as plain fields")
            if not files:
                _invalid("files", "no images: send one or more 'files' parts")
            if len(files) > settings.max_images:
                _invalid("files", f"at most {settings.max_images} images (TSERVE_MAX_IMAGES)")
            encoded = [await _read_upload(i, upload, settings) for i, upload in enumerate(files)]
    except ClientBodyError:  # the body was too large or too slow: 413 / 408 as they are
        raise
    except HTTPException as error:  # Starlette's multipart parser: malformed body, too many parts
        if "Too many files" in str(error.detail):
            _invalid("files", f"at most {settings.max_images} images (TSERVE_MAX_IMAGES)")
        raise BadInput(f"malformed multipart body: {error.detail}") from None
    try:
        options = _form_options(request.app.state.request_models.classify).model_validate(fields)
    except ValidationError as error:
        _invalid_model(error)
    return options, encoded


async def _read_upload(index: int, upload: UploadFile | str, settings: Settings) -> EncodedImage:
    filename = upload.filename if isinstance(upload, UploadFile) else None
    name = f"files[{index}]" + (f" ({filename!r})" if filename else "")
    if not isinstance(upload, UploadFile):
        raise BadInput(f"{name} is a text field, not a file upload")
    if upload.size is not None and upload.size > settings.max_image_bytes:
        raise PayloadTooLarge(f"{name} has {upload.size} bytes; the limit is {settings.max_image_bytes}")
    data = await upload.read(settings.max_image_bytes + 1)
    if len(data) > settings.max_image_bytes:
        raise PayloadTooLarge(f"{name} has more than {settings.max_image_bytes} bytes, the limit")
    return EncodedImage(name, data)
