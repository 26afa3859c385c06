"""The Open Inference Protocol (KServe v2 REST, as Triton serves it and `tritonclient.http` calls it) for the three
models: server and model metadata, liveness and readiness, inference, and Triton's model configuration
(`service.api.oip.signatures.model_config`) and statistics (`service.api.oip.statistics`) extensions. A thin
adapter: tensors (`service.api.oip.protocol`) -> the serving layer -> tensors. The same queues, batching,
deadlines, limits and metrics as the native routes (metrics label `api="oip"`); errors are `{"error": "..."}` as the
protocol says.

The tensors per model, their options, the deadline and the checks are the protocol's core,
`service.api.oip.inference`, which gRPC (`service.api.oip.grpc`) shares.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse

from service.api.oip import inference as oip_inference
from service.api.oip import metadata
from service.api.oip.errors import OIP
from service.api.oip.protocol import HEADER_LENGTH, ModelMetadata, ServerMetadata, encode_response, parse_request
from service.serving.context import resolve

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
    return metadata.server_metadata()


async def server_live() -> dict:
    return {"live": True}


async def server_ready(request: Request) -> JSONResponse:
    ready, _ = request.app.state.registry.readiness()
    return JSONResponse({"ready": ready}, status_code=200 if ready else 503)


ModelName = Annotated[str, PathParam(description="A loaded model: vit, translation or gpt.",
                                      examples=["vit", "translation", "gpt"])]
VersionPath = Annotated[str, PathParam(pattern=r"^[1-9][0-9]{0,8}$", description="A loaded version.", examples=["1"])]


async def model_metadata(request: Request, name: ModelName, version: VersionPath | None = None) -> dict:
    registry = request.app.state.registry
    return metadata.model_metadata(registry, metadata.resolve(registry, name, version))


async def configuration(request: Request, name: ModelName, version: VersionPath | None = None) -> dict:
    registry = request.app.state.registry
    return metadata.configuration(registry, metadata.resolve(registry, name, version))


async def every_statistics(request: Request) -> dict:
    """Every loaded version's statistics."""
    return metadata.statistics(request.app.state.registry, request.app.state.metrics, None, None)


async def statistics(request: Request, name: ModelName, version: VersionPath | None = None) -> dict:
    """A model's statistics (every loaded version of it), or one version's."""
    return metadata.statistics(request.app.state.registry, request.app.state.metrics, name, version)


async def model_ready(request: Request, name: ModelName, version: VersionPath | None = None) -> dict:
    loaded = metadata.resolve(request.app.state.registry, name, version)  # 404 unknown, 503 loading or draining
    return {"name": loaded.name, "ready": True}


async def infer(request: Request, name: ModelName, version: VersionPath | None = None) -> Response:
    loaded = resolve(request, None, name, metadata.parse_version(version))
    body = await request.body()
    inference, tensors, in_json = parse_request(body, request.headers.get(HEADER_LENGTH))
    inference.check_target(loaded.name, loaded.version)
    outputs = await oip_inference.infer(request, loaded, inference, tensors, in_json)
    content, header_length = encode_response(loaded.name, loaded.version, inference, outputs)
    if header_length is None:
        return Response(content, media_type="application/json")
    return Response(content, media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(header_length)})
