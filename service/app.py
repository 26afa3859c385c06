"""The FastAPI application: settings, metrics and the model registry on `app.state`, models loaded in the
lifespan (in the background), routers, error handlers, the request middleware, the gRPC server (on the same event
loop: `service.api.oip.grpc.server`), and graceful shutdown.

Shutdown on SIGTERM: readiness turns 503 at once (draining; gRPC health NOT_SERVING); after `drain_delay_s`
uvicorn stops accepting and lets in-flight requests finish (up to `drain_timeout_s`); then the gRPC server stops
accepting and lets its in-flight calls finish (up to `drain_timeout_s`); then the schedulers drain what they
accepted.
"""

from __future__ import annotations

import logging
import signal
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI

import service
from service.api import admin, control, tokenize
from service.api.native import images, text
from service.api.native.protocol import request_models
from service.api.oip import router as oip
from service.api.oip.grpc import server as grpc_server
from service.api.openai import router as openai
from service.api.openai.protocol import openai_request_models
from service.engines.imaging import ImageDecoder
from service.http.apis import ApiTable
from service.http.auth import ApiKeyMiddleware, ApiKeys, load_api_keys
from service.http.compression import ContentCodingMiddleware
from service.http.docs import install_docs
from service.http.errors import install_error_handlers
from service.http.middleware import RequestMiddleware
from service.models.control import ModelControl
from service.models.registry import ModelRegistry
from service.observability import tracing
from service.observability.metrics import Metrics
from service.settings import Settings, get_settings

log = logging.getLogger(__name__)


def _hook_sigterm(registry: ModelRegistry, drain_delay_s: float) -> None:
    """Chain a handler in front of uvicorn's: mark the registry draining, then let uvicorn shut down."""
    if threading.current_thread() is not threading.main_thread():
        return  # e.g. under TestClient: no signals to handle
    previous = signal.getsignal(signal.SIGTERM)
    if not callable(previous):
        return

    def on_sigterm(signum, frame):
        log.info("SIGTERM: draining (ready -> 503), stopping in %.1fs", drain_delay_s)
        registry.draining = True
        if drain_delay_s > 0:
            threading.Timer(drain_delay_s, previous, args=(signum, frame)).start()
        else:
            previous(signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    metrics = Metrics()
    tracing.configure_from_environment()  # OTEL_* (service.observability.tracing): off unless they ask for it
    registry = ModelRegistry(settings, metrics)
    keys = load_api_keys(settings)  # a bad key setting raises here

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.image_decoder = ImageDecoder(settings)  # its own bounded pool of decoder threads
        # before the models start loading: a gRPC port that cannot be bound fails the start with no thread running
        app.state.grpc = await grpc_server.start(app, ApiKeys(keys))  # None when TSERVE_GRPC_PORT is 0
        registry.start_loading()
        _hook_sigterm(registry, settings.drain_delay_s)
        yield
        if app.state.grpc is not None:
            await app.state.grpc.stop(settings.drain_timeout_s)
        registry.stop(settings.drain_timeout_s)
        await registry.response_cache.close()  # its Redis connections, on the loop that opened them
        tracing.flush()  # the spans still buffered
        app.state.image_decoder.close()

    app = FastAPI(
        title=service.NAME,
        version=service.__version__,
        summary="German->English translation, Shakespeare text generation and Fashion-MNIST classification, "
                "served by ONNX Runtime with continuous and dynamic batching.",
        lifespan=lifespan,
        docs_url=None, redoc_url=None,  # served by install_docs: their assets from the service, not a CDN
    )
    install_docs(app)
    app.state.settings, app.state.metrics, app.state.registry = settings, metrics, registry
    app.state.request_models = models = request_models(settings)
    app.state.model_control = ModelControl(registry, settings.model_control, settings.drain_timeout_s)
    openai_models = openai_request_models(settings)
    routers = [text.build_router(models), images.build_router(models, settings),
               openai.build_router(openai_models), tokenize.build_router(settings, openai_models.chat),
               oip.build_router(), control.build_router(), admin.router]
    for router in routers:
        app.include_router(router)
    apis = ApiTable(routers)  # each request's API (error shape, metrics labels) by its route
    install_error_handlers(app, apis)
    # Starlette: the middleware added last runs outermost, so the API keys are checked inside the request
    # middleware, which still logs and counts (by status) the requests they reject
    app.add_middleware(ContentCodingMiddleware, max_body_bytes=settings.max_body_bytes)  # service.http.compression
    app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(RequestMiddleware, metrics=metrics, apis=apis, max_body_bytes=settings.max_body_bytes,
                       body_timeout_s=settings.body_timeout_s)
    return app
