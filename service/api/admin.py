"""Operations endpoints: `/health/live`, `/health/ready` and `/metrics` (`GET /v1/models` is OpenAI's, in
`service.api.openai.router`)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.api.native.protocol import Liveness, Readiness
from service.http.apis import OPERATIONS

router = APIRouter(tags=["operations"], route_class=OPERATIONS.route_class)


@router.get("/health/live", summary="Liveness: the process answers", response_model=Liveness)
async def live() -> dict:
    return {"status": "live"}


@router.get("/health/ready", summary="Readiness: every configured model is loaded and the server is not draining",
            response_model=Readiness, responses={503: {"model": Readiness, "description": "Not ready, with reasons"}})
async def ready(request: Request) -> JSONResponse:
    registry = request.app.state.registry
    is_ready, reasons = registry.readiness()
    await registry.response_cache.check()  # a Redis marked down is probed again (at most once a second)
    degraded = registry.response_cache.problems()  # served without: ready all the same, and said so
    if is_ready:
        return JSONResponse({"status": "ready", **({"reasons": degraded} if degraded else {})})
    return JSONResponse({"status": "not ready", "reasons": reasons + degraded}, status_code=503)


@router.get("/metrics", summary="Prometheus metrics (text exposition format)", response_class=PlainTextResponse,
            responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}},
                             "description": "Prometheus text exposition format"}})
async def metrics(request: Request) -> Response:
    request.app.state.registry.readiness()  # refresh the tserve_ready gauge
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# Probes and scrapers that ask with HEAD (`curl -I`, some load balancers' health checks) get the GET's status and
# headers (the server sends no body to a HEAD); not in the OpenAPI document, which lists each route once.
for _path, _endpoint in (("/health/live", live), ("/health/ready", ready), ("/metrics", metrics)):
    router.add_api_route(_path, _endpoint, methods=["HEAD"], include_in_schema=False)
