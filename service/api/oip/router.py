"""The Open Inference Protocol (KServe v2 REST, as Triton serves it and `tritonclient.http` calls it) for the three
models: server and model metadata, liveness and readiness, inference, and Triton's model configuration
(`service.api.oip.signatures.model_config`) and statistics (`service.api.oip.statistics`) extensions. A thin
adapter: tensors (`service.api.oip.protocol`) -> the serving layer -> tensors. The same queues, batching,
deadlines, limits and metrics as the native routes (metrics label `api="oip"`); errors are `{"error": "..."}` as the
protocol says.

Tensors per model (its signature, `service.api.oip.signatures`, also in each model's metadata):
- vit: input `IMAGE` BYTES [N] (encoded image files; base64 text when sent as JSON) or `PIXELS` FP32 [N, H, W]
  (or [N, C, H, W]) already scaled to [0, 1]; outputs `PROBABILITIES` FP32 [N, classes] (with the classification
  extension: the top k as "score:index:label") and `LABEL` BYTES [N], the most likely label.
- translation: input `TEXT` BYTES (German, UTF-8, any shape); outputs `TRANSLATION` BYTES and `SCORE` FP32 (the
  input's shape). Decoding options are request `parameters`, as the native API names them (num_beams, ...),
  checked by the native request model, whose `to_params` maps them to the serving call.
- gpt: input `PROMPT` BYTES (any shape); outputs `TEXT` BYTES (the continuation) and `FINISH_REASON` BYTES
  (eos | length | stop); options as `parameters` (max_new_tokens, temperature, seed, stop as one string, ...).
The deadline is the request parameter `timeout` (microseconds, what tritonclient sends), else the server's default.
Each input must have its signature's datatype; a parameter that names what the request gives otherwise (the input
tensors, the model and version of the path, the deadline) is refused, so the tensors' limits always hold.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse

import service
from service.api.fields import ascii_digits
from service.api.oip.errors import OIP
from service.engines.imaging import EncodedImage
from service.errors import BadInput
from service.api.oip.protocol import (
    HEADER_LENGTH,
    RESERVED_PARAMETERS,
    ModelMetadata,
    ServerMetadata,
    classification,
    encode_response,
    parse_request,
    validated_options,
)
from service.api.oip.signatures import PLATFORM, model_config, signature
from service.api.oip.statistics import model_statistics
from service.models.registry import LoadedModel
from service.models.repository import GPT, TRANSLATION, VIT
from service.serving import classify as classification_service
from service.serving import generate as generation
from service.serving import translate as translation
from service.serving.context import deadline_of, label, resolve

EXTENSIONS = ["binary_tensor_data", "classification", "model_configuration", "statistics"]
# Native request fields that an inference request gives in another way, and where: as `parameters` they are refused
# (400), so that they can neither replace the input tensors (and slip past their limits) nor be silently ignored.
GIVEN_OTHERWISE = {"text": "the texts are the TEXT input", "prompt": "the prompts are the PROMPT input",
                   "images": "the images are the IMAGE or PIXELS input", "model": "the model is the URL path's",
                   "version": "the version is the URL path's",
                   "timeout_ms": "the deadline is the `timeout` parameter, in microseconds",
                   "stream": "this protocol's inference does not stream"}
# A PIXELS value is a pixel already scaled to [0, 1]; beyond that range the model's arithmetic can overflow.
PIXEL_RANGE = (0.0, 1.0)
MICROSECONDS_PER_MS = 1000  # the `timeout` parameter is in microseconds, the serving deadline in ms
Tensor = tuple[str, str, np.ndarray]  # name, datatype, array
ERRORS = {status: {"description": text, "content": {"application/json": {"example": {"error": "..."}}}}
          for status, text in {400: "Invalid request or tensors", 401: "Missing or wrong API key",
                               404: "Unknown model or version", 429: "Queue full (Retry-After)",
                               503: "Not ready or draining", 504: "Deadline (timeout) expired"}.items()}


def build_router() -> APIRouter:
    router = APIRouter(tags=["open inference protocol"], route_class=OIP.route_class)
    router.add_api_route("/v2", server_metadata, methods=["GET"], response_model=ServerMetadata,
                         summary="Server metadata")
    router.add_api_route("/v2/health/live", server_live, methods=["GET"], summary="Liveness")
    router.add_api_route("/v2/health/ready", server_ready, methods=["GET"], summary="Readiness", responses=ERRORS)
    # before /v2/models/{name}, which would take "stats" for a model's name (Triton's paths shadow it alike)
    router.add_api_route("/v2/models/stats", every_statistics, methods=["GET"], responses=ERRORS,
                         summary="Statistics of every loaded model version (Triton's statistics extension)")
    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        router.add_api_route(f"{prefix}/config", configuration, methods=["GET"], responses=ERRORS,
                             summary="Model configuration (Triton's model configuration extension)")
        router.add_api_route(f"{prefix}/stats", statistics, methods=["GET"], responses=ERRORS,
                             summary="Model statistics (Triton's statistics extension)")
        router.add_api_route(prefix, model_metadata, methods=["GET"], response_model=ModelMetadata,
                             responses=ERRORS, summary="Model metadata: inputs and outputs")
        router.add_api_route(f"{prefix}/ready", model_ready, methods=["GET"], responses=ERRORS,
                             summary="Model readiness")
        router.add_api_route(f"{prefix}/infer", infer, methods=["POST"], responses=ERRORS, summary="Inference",
                             openapi_extra={"requestBody": {"required": True, "content": {
                                 "application/json": {"schema": {"type": "object"}},
                                 "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
    return router


async def server_metadata() -> dict:
    return {"name": service.NAME, "version": service.__version__, "extensions": EXTENSIONS}


async def server_live() -> dict:
    return {"live": True}


async def server_ready(request: Request) -> JSONResponse:
    ready, _ = request.app.state.registry.readiness()
    return JSONResponse({"ready": ready}, status_code=200 if ready else 503)


def _version(version: str | None) -> int | None:
    if version is None:
        return None
    if not ascii_digits(version) or int(version) < 1:
        raise BadInput(f"version {version!r} is not a positive integer")
    return int(version)


def _resolve(request: Request, name: str, version: str | None) -> LoadedModel:
    return request.app.state.registry.resolve(None, name, _version(version))


ModelName = Annotated[str, PathParam(description="A loaded model: vit, translation or gpt.",
                                      examples=["vit", "translation", "gpt"])]
VersionPath = Annotated[str, PathParam(pattern=r"^[1-9][0-9]{0,8}$", description="A loaded version.", examples=["1"])]


async def model_metadata(request: Request, name: ModelName, version: VersionPath | None = None) -> dict:
    loaded = _resolve(request, name, version)
    tensors = signature(loaded)

    def described(tensors):
        return [{"name": n, "datatype": d, "shape": s} for n, d, s in tensors]

    versions = _versions(request, loaded.name)
    return {"name": loaded.name, "versions": [str(v) for v in versions], "platform": PLATFORM,
            "inputs": described(tensors.inputs), "outputs": described(tensors.outputs)}


def _loaded(request: Request) -> dict:
    """A copy of the loaded versions by (name, version): model control changes the registry's while we read."""
    return dict(request.app.state.registry.loaded)


def _versions(request: Request, name: str) -> list[int]:
    return sorted(v for (n, v) in _loaded(request) if n == name)


async def configuration(request: Request, name: ModelName, version: VersionPath | None = None) -> dict:
    loaded = _resolve(request, name, version)
    return model_config(loaded, _versions(request, loaded.name))


async def every_statistics(request: Request) -> dict:
    """Every loaded version's statistics."""
    return model_statistics(request.app.state.metrics, [loaded for _, loaded in sorted(_loaded(request).items())])


async def statistics(request: Request, name: ModelName, version: VersionPath | None = None) -> dict:
    """A model's statistics (every loaded version of it), or one version's."""
    if version is None:
        model = _resolve(request, name, None).name  # 404 for an unknown model
        versions = [loaded for (n, _), loaded in sorted(_loaded(request).items()) if n == model]
    else:
        versions = [_resolve(request, name, version)]
    return model_statistics(request.app.state.metrics, versions)


async def model_ready(request: Request, name: ModelName, version: VersionPath | None = None) -> dict:
    loaded = _resolve(request, name, version)  # 404 unknown, 503 loading or draining
    return {"name": loaded.name, "ready": True}


async def infer(request: Request, name: ModelName, version: VersionPath | None = None) -> Response:
    loaded = resolve(request, None, name, _version(version))
    body = await request.body()
    inference, tensors, in_json = parse_request(body, request.headers.get(HEADER_LENGTH))
    inference.check_target(loaded.name, loaded.version)
    options = {k: v for k, v in inference.parameters.items() if k not in RESERVED_PARAMETERS}
    if given := sorted(set(options) & set(GIVEN_OTHERWISE)):
        raise BadInput("; ".join(f"parameter {key!r} is not an option here: {GIVEN_OTHERWISE[key]}" for key in given))
    timeout_us = inference.parameters.get("timeout")  # an integer >= 1 (parse_request checked)
    timeout_ms = None if timeout_us is None else max(1, timeout_us // MICROSECONDS_PER_MS)
    settings = request.app.state.settings
    if timeout_ms is not None and timeout_ms > settings.max_timeout_ms:
        raise BadInput(f"parameters.timeout exceeds TSERVE_MAX_TIMEOUT_MS ({settings.max_timeout_ms} ms)")
    deadline = deadline_of(request, timeout_ms)
    datatypes = signature(loaded).input_datatypes()
    if unknown := sorted(set(tensors) - set(datatypes)):
        raise BadInput(f"unknown input(s) {unknown} for model {loaded.name!r} (inputs: {sorted(datatypes)})")
    for tensor in inference.inputs:
        if tensor.datatype != datatypes[tensor.name]:
            raise BadInput(f"input {tensor.name!r} must be {datatypes[tensor.name]}, got {tensor.datatype}")
    outputs = await ADAPTERS[loaded.kind](request, loaded, tensors, in_json, options, deadline)
    outputs = _select(loaded, inference, outputs)
    content, header_length = encode_response(loaded.name, loaded.version, inference, outputs)
    if header_length is None:
        return Response(content, media_type="application/json")
    return Response(content, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(header_length)})


def _select(loaded: LoadedModel, inference, outputs: list[Tensor]) -> list[Tensor]:
    """The outputs the request asked for (all when it names none), with the classification extension applied."""
    if not inference.outputs:
        return outputs
    by_name = {name: (name, datatype, array) for name, datatype, array in outputs}
    selected = []
    for wanted in inference.outputs:
        if wanted.name not in by_name:
            raise BadInput(f"unknown output {wanted.name!r} for model {loaded.name!r} (outputs: {sorted(by_name)})")
        name, datatype, array = by_name[wanted.name]
        k = wanted.parameters.get("classification")  # an integer >= 1 (parse_request checked)
        if k is not None:
            if name != "PROBABILITIES":
                raise BadInput(f"classification: a count on PROBABILITIES only, not on {name!r}")
            name, datatype, array = name, "BYTES", classification(array, loaded.engine.labels, k)
        selected.append((name, datatype, array))
    return selected


# --- per model ---------------------------------------------------------------------------------------------------


def _only(tensors: dict[str, np.ndarray], names: tuple[str, ...]) -> tuple[str, np.ndarray]:
    given = [n for n in names if n in tensors]
    if len(given) != 1:
        raise BadInput(f"give exactly one input of {list(names)}")
    return given[0], tensors[given[0]]


def _texts(name: str, array: np.ndarray) -> list[str]:
    try:
        return [x.decode("utf-8") for x in array.reshape(-1)]
    except UnicodeDecodeError:
        raise BadInput(f"input {name!r}: an element is not UTF-8 text") from None


async def _vit(request: Request, loaded: LoadedModel, tensors, in_json: set[str], options: dict,
               deadline: float) -> list[Tensor]:
    if options:
        raise BadInput(f"unknown parameter(s) {sorted(options)} for an image model")
    engine, settings = loaded.engine, request.app.state.settings
    name, array = _only(tensors, ("IMAGE", "PIXELS"))
    label(request, loaded, "classify")
    count = len(array) if array.ndim else 0
    if not 1 <= count <= settings.max_images:
        raise BadInput(f"input {name!r}: 1 to {settings.max_images} images (TSERVE_MAX_IMAGES), got {count}")
    if name == "IMAGE":
        if array.ndim != 1:
            raise BadInput(f"input 'IMAGE' has shape {list(array.shape)}; expected [N]")
        images = [EncodedImage(f"IMAGE[{i}]", x.decode("ascii", "replace") if name in in_json else x)
                  for i, x in enumerate(array)]
        probabilities = await classification_service.classify(request, loaded, images, deadline)
    else:
        size, channels = engine.size, engine.channels
        shapes = [(count, channels, size, size)] + ([(count, size, size)] if channels == 1 else [])
        if array.shape not in shapes:
            raise BadInput(f"input 'PIXELS' has shape {list(array.shape)}; expected {[list(s) for s in shapes]}")
        low, high = PIXEL_RANGE
        if not ((array >= low) & (array <= high)).all():  # a NaN fails both comparisons
            raise BadInput(f"input 'PIXELS' holds a value outside [{low:g}, {high:g}] (or a NaN): pixels must be "
                           "scaled to [0, 1]")
        pixels = engine.normalize(array.reshape(count, channels, size, size))
        probabilities = await classification_service.classify_pixels(request, loaded, pixels, deadline)
    labels = np.array([engine.labels[i].encode() for i in probabilities.argmax(axis=1)], dtype=object)
    return [("PROBABILITIES", "FP32", probabilities), ("LABEL", "BYTES", labels)]


async def _translation(request: Request, loaded: LoadedModel, tensors, in_json: set[str], options: dict,
                       deadline: float) -> list[Tensor]:
    name, array = _only(tensors, ("TEXT",))
    texts = _texts(name, array)
    if options.get("num_return_sequences", 1) != 1:
        raise BadInput("num_return_sequences is not available here: one translation per text")
    body = validated_options(request.app.state.request_models.translate, {**options, "text": texts}, "parameters")
    params = body.to_params()
    label(request, loaded, params.mode)
    results = await translation.translate(request, loaded, texts, params, deadline)
    best = [completions[0] for completions in results]
    return [("TRANSLATION", "BYTES", np.array([c.text.encode() for c in best], dtype=object).reshape(array.shape)),
            ("SCORE", "FP32", np.array([c.score for c in best], dtype=np.float32).reshape(array.shape))]


async def _gpt(request: Request, loaded: LoadedModel, tensors, in_json: set[str], options: dict,
               deadline: float) -> list[Tensor]:
    name, array = _only(tensors, ("PROMPT",))
    prompts = _texts(name, array)
    if not prompts or len(prompts) > request.app.state.settings.max_texts:
        raise BadInput(f"input 'PROMPT': 1 to {request.app.state.settings.max_texts} prompts (TSERVE_MAX_TEXTS)")
    if isinstance(options.get("stop"), str):
        options = {**options, "stop": [options["stop"]]}
    bodies = [validated_options(request.app.state.request_models.generate, {**options, "prompt": p}, f"PROMPT[{i}]")
              for i, p in enumerate(prompts)]
    params = bodies[0].to_params()
    label(request, loaded, params.mode)
    ids = await generation.encode_prompts(loaded, prompts, params.max_new_tokens, "parameters.max_new_tokens")
    results = await generation.generate(request, loaded, ids, params, deadline)
    best = [completions[0] for completions in results]
    return [("TEXT", "BYTES", np.array([c.text.encode() for c in best], dtype=object).reshape(array.shape)),
            ("FINISH_REASON", "BYTES",
             np.array([c.finish_reason.encode() for c in best], dtype=object).reshape(array.shape))]


ADAPTERS: dict[str, Callable[..., Awaitable[list[Tensor]]]] = {VIT: _vit, TRANSLATION: _translation, GPT: _gpt}

