"""`POST /v1/classify`: image classification with the ViT, as a thin route (vLLM's entrypoint layout):
parse the body -> validate against the settings -> decode and preprocess off the event loop -> submit to the
model's `DynamicBatcher` -> await the logits within the deadline -> top-k softmax predictions.

Two request shapes are accepted (like Triton's and TorchServe's HTTP frontends):
- `multipart/form-data`: one or more `files` parts (any image Pillow reads, any size or mode) and optional
  `top_k`, `model`, `version`, `timeout_ms` fields;
- `application/json`: `ClassifyJSONRequest`, images as base64 strings (a `data:image/...;base64,` prefix is fine).

Bad input is never a 500: 415 for another content type, 422 for invalid fields, 413 for too many / too large
images (the pixel count is read from the header before any pixel is decoded), 400 naming the image that could
not be decoded.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import time
from dataclasses import dataclass

import numpy as np
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from PIL import Image, UnidentifiedImageError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from service.errors import BadInput, DeadlineExceeded, PayloadTooLarge, ServiceError, UnsupportedMediaType
from service.protocol import ClassifyJSONRequest, ClassifyResponse, ErrorResponse, Prediction
from service.scheduling.dynamic import ImageJob
from service.settings import Settings

router = APIRouter(tags=["images"])

ACCEPTED_TYPES = ("multipart/form-data", "application/json")
FORM_FIELDS = ("top_k", "model", "version", "timeout_ms")


class _FormOptions(ClassifyJSONRequest):
    """The multipart fields, validated by the same rules as the JSON body (the images come as `files` parts)."""

    images: list[str] = []


@dataclass
class _EncodedImage:
    name: str  # how error messages refer to it: "images[2]" or "files[0] ('shoe.png')"
    data: bytes | str  # file bytes, or base64 text (decoded off the event loop)


# --- OpenAPI ------------------------------------------------------------------------------------------------

_MULTIPART_SCHEMA = {
    "type": "object",
    "required": ["files"],
    "properties": {
        "files": {"type": "array", "description": "One part per image (PNG, JPEG, WebP, BMP, GIF, TIFF, ...; any "
                  "size or mode: images are converted, resized and normalised as the model's config says).",
                  "items": {"type": "string", "format": "binary", "contentMediaType": "application/octet-stream"}},
        "top_k": {"type": "integer", "minimum": 1, "default": 5,
                  "description": "Predictions per image, best first (at most the model's number of labels)."},
        "model": {"type": "string", "description": "Model name; default: the default image model."},
        "version": {"type": "integer", "minimum": 1, "description": "Model version; default: the highest loaded."},
        "timeout_ms": {"type": "integer", "minimum": 1,
                       "description": "Deadline for decoding + queueing + inference; past it: 504."},
    },
}
_JSON_SCHEMA = ClassifyJSONRequest.model_json_schema(ref_template="#/components/schemas/{model}")


def _error(description: str, **extra) -> dict:
    return {"model": ErrorResponse, "description": description, **extra}


_RESPONSES = {
    400: _error("An image could not be decoded or is not valid base64 (the message names which), a malformed "
                "multipart body, a timeout_ms over TSERVE_MAX_TIMEOUT_MS, or a model that is not an image model."),
    404: _error("Unknown model or version."),
    413: _error("Too many images (TSERVE_MAX_IMAGES), an image over TSERVE_MAX_IMAGE_BYTES or over "
                "TSERVE_MAX_IMAGE_PIXELS pixels, or a body over TSERVE_MAX_BODY_BYTES."),
    415: _error("Content-Type is neither multipart/form-data nor application/json."),
    422: _error("Invalid fields: top_k outside 1..number of labels, an unknown field, no images, invalid JSON."),
    429: _error("The model's queue is full.", headers={"Retry-After": {
        "description": "Seconds after which the queue is expected to have room.", "schema": {"type": "integer"}}}),
    503: _error("The model is not loaded yet, or the server is shutting down."),
    504: _error("The deadline (timeout_ms) passed before the images were classified."),
}

_DESCRIPTION = """Classify one or more images; returns the `top_k` most likely labels per image, in request order,
with softmax probabilities.

Send either **multipart/form-data** (one `files` part per image, plus optional `top_k`, `model`, `version`,
`timeout_ms` fields), e.g. `curl -F files=@shoe.png -F files=@shirt.jpg -F top_k=3 .../v1/classify`, or
**application/json** with base64-encoded image files: `{"images": ["iVBORw0...", ...], "top_k": 3}`.

Any image Pillow reads is accepted, in any size or mode: it is converted to the model's mode (transparent pixels
on white), resized and normalised as the model's config says. Requests are batched with other requests for the
same model (dynamic batching: up to TSERVE_VIT_MAX_BATCH_SIZE images, waiting at most
TSERVE_VIT_MAX_QUEUE_DELAY_MS for a batch to fill)."""


# --- the route ----------------------------------------------------------------------------------------------


@router.post(
    "/v1/classify",
    response_model=ClassifyResponse,
    summary="Classify images (ViT)",
    description=_DESCRIPTION,
    responses=_RESPONSES,
    openapi_extra={"requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": _MULTIPART_SCHEMA, "encoding": {"files": {"contentType": "image/*"}}},
        "application/json": {"schema": _JSON_SCHEMA},
    }}},
)
async def classify(request: Request) -> ClassifyResponse:
    received = time.monotonic()
    request.state.mode = "classify"
    settings: Settings = request.app.state.settings
    options, encoded = await _parse(request, settings)
    if len(encoded) > settings.max_images:
        raise PayloadTooLarge(f"{len(encoded)} images; at most {settings.max_images} per request")
    timeout_ms = options.timeout_ms or settings.default_timeout_ms
    if timeout_ms > settings.max_timeout_ms:
        raise BadInput(f"timeout_ms={timeout_ms} exceeds the maximum of {settings.max_timeout_ms}")

    loaded = request.app.state.registry.resolve("vit", options.model, options.version)
    request.state.model, request.state.version = loaded.name, loaded.version
    labels = loaded.engine.labels
    if options.top_k > len(labels):
        _invalid("top_k", f"must be <= {len(labels)}, the number of labels of {loaded.name}")

    pixels = await run_in_threadpool(_preprocess_all, encoded, loaded.engine, settings)  # (n, C, H, W)
    job = loaded.scheduler.submit(ImageJob(pixels=pixels, deadline=received + timeout_ms / 1000))
    logits = await _wait(job)  # (n, classes)
    return ClassifyResponse(model=loaded.name, version=loaded.version,
                            predictions=_top_k(logits, labels, options.top_k))


async def _wait(job: ImageJob) -> np.ndarray:
    """The job's logits, or DeadlineExceeded (504) at its deadline; the job is cancelled if nobody waits for it."""
    try:
        remaining = max(0.0, job.deadline - time.monotonic())
        return await asyncio.wait_for(asyncio.wrap_future(job.future), timeout=remaining)
    except TimeoutError:
        job.cancel()
        raise DeadlineExceeded("the request's deadline expired before its images were classified") from None
    except asyncio.CancelledError:  # the client went away
        job.cancel()
        raise


def _top_k(logits: np.ndarray, labels: list[str], k: int) -> list[list[Prediction]]:
    """Softmax over each row of logits (n, classes); the k most likely labels per row, best first."""
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities = shifted / shifted.sum(axis=1, keepdims=True)
    top = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
    return [[Prediction(label=labels[i], index=int(i), score=float(p[i])) for i in row]
            for p, row in zip(probabilities, top)]


# --- parsing ------------------------------------------------------------------------------------------------


def _invalid(field: str, message: str):
    """Raise a 422 in the same shape as every other validation error of the API."""
    raise RequestValidationError([{"type": "value_error", "loc": ("body", field), "msg": message}])


def _invalid_model(error: ValidationError):
    raise RequestValidationError(error.errors(include_url=False, include_context=False))


async def _parse(request: Request, settings: Settings) -> tuple[ClassifyJSONRequest, list[_EncodedImage]]:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type == "application/json":
        return await _parse_json(request, settings)
    if media_type == "multipart/form-data":
        return await _parse_multipart(request, settings)
    raise UnsupportedMediaType(f"Content-Type {media_type or '(none)'!r} is not supported; send "
                               f"{' or '.join(ACCEPTED_TYPES)}")


async def _parse_json(request: Request, settings: Settings) -> tuple[ClassifyJSONRequest, list[_EncodedImage]]:
    body = await request.body()
    if len(body) > settings.max_body_bytes:
        raise PayloadTooLarge(f"the body has {len(body)} bytes; the limit is {settings.max_body_bytes}")
    try:
        options = ClassifyJSONRequest.model_validate_json(body)
    except ValidationError as error:
        _invalid_model(error)
    return options, [_EncodedImage(f"images[{i}]", text) for i, text in enumerate(options.images)]


async def _parse_multipart(request: Request, settings: Settings) -> tuple[ClassifyJSONRequest, list[_EncodedImage]]:
    try:
        async with request.form(max_files=settings.max_images, max_fields=32) as form:
            files, fields = [], {}
            for key, value in form.multi_items():
                if key == "files":
                    files.append(value)
                elif key in FORM_FIELDS and not isinstance(value, UploadFile):
                    if key in fields:
                        _invalid(key, "given more than once")
                    if value != "":  # an empty field (as HTML forms send) means the default
                        fields[key] = value
                else:
                    _invalid(key, f"unknown or misplaced form field; send images as 'files' parts and "
                                  f"{', '.join(FORM_FIELDS)} as plain fields")
            if not files:
                _invalid("files", "no images: send one or more 'files' parts")
            if len(files) > settings.max_images:
                raise PayloadTooLarge(f"{len(files)} images; at most {settings.max_images} per request")
            encoded = [await _read_upload(i, upload, settings) for i, upload in enumerate(files)]
    except HTTPException as error:  # Starlette's multipart parser: malformed body, too many parts
        if "Too many files" in str(error.detail):
            raise PayloadTooLarge(f"too many files; at most {settings.max_images} images per request") from None
        raise BadInput(f"malformed multipart body: {error.detail}") from None
    try:
        options = _FormOptions.model_validate(fields)
    except ValidationError as error:
        _invalid_model(error)
    return options, encoded


async def _read_upload(index: int, upload: UploadFile | str, settings: Settings) -> _EncodedImage:
    filename = upload.filename if isinstance(upload, UploadFile) else None
    name = f"files[{index}]" + (f" ({filename!r})" if filename else "")
    if not isinstance(upload, UploadFile):
        raise BadInput(f"{name} is a text field, not a file upload")
    if upload.size is not None and upload.size > settings.max_image_bytes:
        raise PayloadTooLarge(f"{name} has {upload.size} bytes; the limit is {settings.max_image_bytes}")
    data = await upload.read(settings.max_image_bytes + 1)
    if len(data) > settings.max_image_bytes:
        raise PayloadTooLarge(f"{name} has more than {settings.max_image_bytes} bytes, the limit")
    return _EncodedImage(name, data)


# --- decoding (a worker thread) -----------------------------------------------------------------------------


def _preprocess_all(images: list[_EncodedImage], engine, settings: Settings) -> np.ndarray:
    return np.stack([_preprocess(image, engine, settings) for image in images])  # (n, C, H, W)


def _preprocess(image: _EncodedImage, engine, settings: Settings) -> np.ndarray:
    data = _b64decode(image, settings) if isinstance(image.data, str) else image.data
    if len(data) > settings.max_image_bytes:
        raise PayloadTooLarge(f"{image.name} has {len(data)} bytes; the limit is {settings.max_image_bytes}")
    if not data:
        raise BadInput(f"{image.name} is empty")
    try:
        with Image.open(io.BytesIO(data)) as decoded:
            width, height = decoded.size  # from the header: no pixel decoded yet
            if width * height > settings.max_image_pixels:
                raise PayloadTooLarge(f"{image.name} is {width}x{height} = {width * height} pixels; the limit is "
                                      f"{settings.max_image_pixels}")
            decoded.load()
            return engine.preprocess(decoded)
    except ServiceError:
        raise
    except Image.DecompressionBombError as error:
        raise PayloadTooLarge(f"{image.name}: {error}") from None
    except UnidentifiedImageError:
        raise BadInput(f"{image.name} is not an image format Pillow can read") from None
    except Exception as error:  # truncated or corrupt files, modes that cannot be converted
        raise BadInput(f"{image.name} could not be decoded: {error}") from None


def _b64decode(image: _EncodedImage, settings: Settings) -> bytes:
    text = image.data
    if text.startswith("data:"):  # a data URL: data:image/png;base64,....
        text = text.partition(",")[2]
    text = "".join(text.split())  # line-wrapped base64 (as `base64` prints it) is fine
    if len(text) > (settings.max_image_bytes + 2) // 3 * 4:
        raise PayloadTooLarge(f"{image.name} has more than {settings.max_image_bytes} bytes, the limit")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadInput(f"{image.name} is not valid base64") from None
