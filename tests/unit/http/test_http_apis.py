"""service.http.apis on a small app (no models, ~1 s): each router's API decides the error shape and the metrics'
`api`/`endpoint` labels by its route, never by its URL; an unmatched path takes the shape of the API whose root
holds it; a request answered before routing (a declared body over the limit) still finds its route."""

from __future__ import annotations

import logging

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from pydantic import BaseModel

from service.api.oip.errors import OIP
from service.api.openai.errors import OPENAI
from service.errors import NotFound
from service.http.apis import NATIVE, OPERATIONS, ApiTable
from service.http.errors import error_payload, install_error_handlers
from service.http.middleware import RequestMiddleware
from service.observability.metrics import Metrics

MAX_BODY_BYTES = 1_000


class Body(BaseModel):
    n: int


async def missing(body: Body):
    raise NotFound("no such thing")


async def ok():
    return {"ok": True}


def _router(api, tags, paths) -> APIRouter:
    router = APIRouter(tags=tags, route_class=api.route_class)
    for path in paths:
        router.add_api_route(path, missing, methods=["POST"])
    return router


@pytest.fixture(scope="module")
def app():
    routers = [_router(NATIVE, ["native"], ["/v1/translate"]), _router(OPENAI, ["openai"], ["/v1/completions"]),
               _router(OIP, ["oip"], ["/v2/models/{name}/infer", "/v2/models/{name}/versions/{version}/infer"])]
    operations = APIRouter(route_class=OPERATIONS.route_class)
    operations.add_api_route("/health/live", ok, methods=["GET"])
    routers.append(operations)
    app = FastAPI()
    for router in routers:
        app.include_router(router)
    apis = ApiTable(routers)
    install_error_handlers(app, apis)
    app.state.metrics = metrics = Metrics()
    app.add_middleware(RequestMiddleware, metrics=metrics, apis=apis, max_body_bytes=MAX_BODY_BYTES,
                       body_timeout_s=5.0)
    return app


@pytest.fixture(scope="module")
def client(app):
    return TestClient(app)


@pytest.mark.parametrize("method, path, status, body", [
    ("POST", "/v1/translate", 404, {"error": {"type": "not_found", "message": "no such thing"}}),
    ("POST", "/v1/completions", 404, {"error": {"message": "no such thing", "type": "invalid_request_error",
                                                "param": None, "code": "not_found"}}),
    ("POST", "/v2/models/m/infer", 404, {"error": "no such thing"}),
    ("POST", "/v2/models/m/versions/2/infer", 404, {"error": "no such thing"}),
    # a route that matched by its path only (405) is its API's
    ("GET", "/v1/completions", 405, {"error": {"message": "Method Not Allowed", "type": "invalid_request_error",
                                               "param": None, "code": "method_not_allowed"}}),
    ("GET", "/v2/models/m/infer", 405, {"error": "Method Not Allowed"}),
    # no route: the API whose root holds the path, else the native shape
    ("GET", "/v2/nothing/here", 404, {"error": "Not Found"}),
    ("GET", "/v2", 404, {"error": "Not Found"}),
    ("GET", "/v1/nothing", 404, {"error": {"type": "not_found", "message": "Not Found"}}),
    ("GET", "/v2x", 404, {"error": {"type": "not_found", "message": "Not Found"}}),
])
def test_an_error_has_the_shape_of_the_api_of_its_route(client, method, path, status, body):
    response = client.request(method, path, json={"n": 1})
    assert (response.status_code, response.json()) == (status, body)


@pytest.mark.parametrize("path, status, body", [
    ("/v1/translate", 422, {"error": {"type": "invalid_request", "message": "n: Field required"}}),
    ("/v1/completions", 400, {"error": {"message": "n: Field required", "type": "invalid_request_error",
                                        "param": "n", "code": "invalid_request"}}),
    ("/v2/models/m/infer", 400, {"error": "n: Field required"}),
])
def test_a_schema_error_is_a_400_where_the_api_says_so(client, path, status, body):
    response = client.post(path, json={})
    assert (response.status_code, response.json()) == (status, body)


def test_a_request_answered_before_routing_still_finds_its_route(client, app):
    """A declared body over the limit is answered by the middleware before any route runs: in the shape of the route
    the path would have matched, and counted under its labels."""
    response = client.post("/v2/models/m/infer", content=b"x" * (MAX_BODY_BYTES + 1))
    assert response.status_code == 413 and isinstance(response.json()["error"], str)
    metrics = generate_latest(app.state.metrics.registry).decode()
    assert any(line.startswith("tserve_request_duration_seconds_count{") and 'api="oip"' in line
               and 'endpoint="/v2/models/{model}/infer"' in line and 'status="413"' in line
               for line in metrics.splitlines())


def test_the_metrics_labels_come_from_the_route(client, app, caplog):
    caplog.set_level(logging.INFO, logger="tserve.access")
    client.post("/v2/models/m/versions/3/infer", json={"n": 1})
    client.post("/v1/completions", json={"n": 1})
    client.get("/v1/nothing")
    client.get("/health/live", headers={"X-Request-ID": "operations-1"})
    counted = {(line.split('api="')[1].split('"')[0], line.split('endpoint="')[1].split('"')[0])
               for line in generate_latest(app.state.metrics.registry).decode().splitlines()
               if line.startswith("tserve_request_duration_seconds_count{")}
    assert ("oip", "/v2/models/{model}/infer") in counted and ("openai", "/v1/completions") in counted
    assert not any(endpoint in ("/v1/nothing", "other", "/health/live") for _, endpoint in counted)
    logged = {getattr(record, "fields", {}).get("request_id") for record in caplog.records}
    assert "operations-1" not in logged  # probes are not access-logged


def test_error_payload_renders_in_the_apis_shape():
    assert error_payload(OPENAI, 422, "invalid_request", "bad", "n") == (
        400, {"error": {"message": "bad", "type": "invalid_request_error", "param": "n", "code": "invalid_request"}})
    assert error_payload(OIP, 422, "invalid_request", "bad") == (400, {"error": "bad"})
    assert error_payload(NATIVE, 429, "queue_full", "lone \ud800") == (
        429, {"error": {"type": "queue_full", "message": "lone \\ud800"}})
