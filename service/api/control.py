"""Triton's model repository extension of the Open Inference Protocol, for loading and unloading model versions
without a restart (`service.models.control`; off unless `TSERVE_MODEL_CONTROL=true`, guarded by the API keys):

- `POST /v2/repository/index`: every version of every model with its state (READY, LOADING, UNAVAILABLE) and why,
  and every folder the repository skips (a bad version folder name, an unreadable `config.json`) with why;
- `POST /v2/repository/models/{name}/load`: load a version (body `{"parameters": {"version": "2"}}`; default: the
  highest valid one in the repository), warmed and checked before it takes requests, then the model's active
  version;
- `POST /v2/repository/models/{name}/unload`: unload a version (default: every loaded one) once its in-flight
  requests have finished.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request

from service.api.oip.errors import OIP
from service.errors import BadInput, json_error_reason
from service.models.control import parse_version

SUPPORTED_PARAMETERS = {"version", "unload_dependents"}  # unload_dependents: tritonclient sends it; no ensembles here


ERRORS = {status: {"description": text, "content": {"application/json": {"example": {"error": "..."}}}}
          for status, text in {400: "Invalid body or version, or the version failed to load (the reason)",
                               401: "Missing or wrong API key", 403: "Model control is off (TSERVE_MODEL_CONTROL)",
                               404: "Unknown model or version"}.items()}


def build_router() -> APIRouter:
    router = APIRouter(tags=["model repository"], route_class=OIP.route_class)
    router.add_api_route("/v2/repository/index", index, methods=["POST"], responses=ERRORS,
                         summary="Every model version and its state")
    router.add_api_route("/v2/repository/models/{name}/load", load, methods=["POST"], responses=ERRORS,
                         summary="Load a model version (warmed, then active) without a restart")
    router.add_api_route("/v2/repository/models/{name}/unload", unload, methods=["POST"], responses=ERRORS,
                         summary="Unload a model version once its requests have finished")
    return router


async def _parameters(request: Request) -> dict[str, Any]:
    body = await request.body()
    try:
        payload = json.loads(body) if body.strip() else {}
    except (ValueError, RecursionError) as error:  # RecursionError: nested too deeply for the parser
        raise BadInput(f"the body is not valid JSON: {json_error_reason(error)}") from None
    parameters = payload.get("parameters", {}) if isinstance(payload, dict) else None
    if not isinstance(parameters, dict):
        raise BadInput('expected a JSON object {"parameters": {...}}')
    return parameters


def requested_version(parameters: dict[str, Any]) -> int | None:
    """The version a load or unload request's parameters (REST's body, gRPC's message) name, None for the default;
    400 for a parameter this server lacks or a version that is no version number."""
    if unsupported := sorted(set(parameters) - SUPPORTED_PARAMETERS):
        raise BadInput(f"unsupported parameter(s) {unsupported}: a version is loaded from the repository as it is")
    return parse_version(parameters.get("version"))


async def index(request: Request) -> list[dict]:
    """Read-only, so answered with model control off too."""
    return request.app.state.model_control.index()


async def load(request: Request, name: str) -> dict:
    request.app.state.model_control.check_enabled()  # 403 before anything of the request is read
    version = requested_version(await _parameters(request))
    loaded = await request.app.state.model_control.load(name, version)
    return {"name": loaded.name, "version": str(loaded.version), "state": "READY"}


async def unload(request: Request, name: str) -> dict:
    request.app.state.model_control.check_enabled()  # 403 before anything of the request is read
    version = requested_version(await _parameters(request))
    versions = await request.app.state.model_control.unload(name, version)
    return {"name": name, "versions": [str(v) for v in versions], "state": "UNAVAILABLE"}
