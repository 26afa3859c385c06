"""The service on Ray Serve: the whole FastAPI app of `service.app.create_app` as ONE Serve deployment, each replica a
complete service process (its registry, its continuous batcher per text model, its dynamic batcher for images),
behind Ray's HTTP proxy. `serve run deploy/ray/serve_config.yaml` deploys it; `build_app` is the config's
import path (Ray Serve's application builder), its `args` an `AppArgs`.

Why the whole app through `@serve.ingress` and not deployments around the engines (docs/deployment.md, "Ray Serve"):
- Continuous batching admits a request into a batch that is already decoding, at a step boundary, inside the
  process that holds the batch's KV cache (service/scheduling/continuous.py). Ray's own batching, `@serve.batch`,
  collects calls for a wait and runs them as one batch to the end: a request that comes one step late waits for the
  whole batch. Keeping our scheduler in an engine deployment would work, but every token of every stream would then
  cross Ray twice (engine -> API deployment -> proxy) and each request would pay a second actor call; the images'
  dynamic batcher (a batch closes at a size or a delay) is the same story. One replica = one scheduler per model,
  exactly as one `make serve` process: what was measured and tested there holds per replica.
- Streaming: a FastAPI `StreamingResponse` (the SSE of /v1/generate and the OpenAI routes) passes through the proxy
  as ASGI messages, each chunk as it is sent, with no code of ours; every API (native, OpenAI, Open Inference
  Protocol over REST), the error shapes and the deadlines are the service's own, unchanged.
- What it costs: a replica holds all three models (scale per model with one application per model, each with
  TSERVE_MODELS and its own route prefix); the gRPC port is off (Ray's proxy carries HTTP; Serve's gRPC proxy would
  need our servicer registered as a Serve gRPC service); `/metrics` through the proxy is one replica's, so scrape
  Ray's metrics (ray_serve_*) for the deployment as a whole.

A replica answers Ray's health check only once its models are loaded (the first check waits for them, up to
`LOAD_TIMEOUT_S`), and fails it while a model is missing: Ray replaces it. Its CPUs (`ray_actor_options.num_cpus`)
are ONNX Runtime's intra-op threads, set once in `AppArgs.intra_op_threads`: a replica asks Ray for the cores its
sessions use, so Ray never packs more replicas on a node than it has cores for.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application

DEPLOYMENT = "tserve"
# How long a new replica's first health check waits for its models to load (the release models load and warm up in
# seconds; a cold, busy node may take a minute), and how often it looks.
LOAD_TIMEOUT_S = 180.0
LOAD_POLL_S = 0.2
# Requests one replica takes at once before the proxy queues them (Ray's max_ongoing_requests): enough for the
# continuous batcher to keep a batch of rows decoding and the image batcher to fill a batch (TSERVE_VIT_MAX_BATCH_SIZE
# images); more would only move Ray's queue into ours, behind one replica, where a new replica cannot take it over.
MAX_ONGOING_REQUESTS = 32
# Ray's default autoscaling windows are for slow, large fleets (30 s up, 600 s down): these react within seconds to a
# burst and give capacity back after a minute of quiet. Ongoing requests per replica is what the autoscaler targets:
# 4 keeps a decoding batch of a few rows per replica before another replica is asked for.
TARGET_ONGOING_REQUESTS = 4.0
MIN_REPLICAS, MAX_REPLICAS = 1, 4
UPSCALE_DELAY_S, DOWNSCALE_DELAY_S = 5.0, 60.0
METRICS_INTERVAL_S, LOOK_BACK_PERIOD_S = 1.0, 10.0
# SIGTERM-like drain: Ray stops routing to a replica, waits for its ongoing requests (as TSERVE_DRAIN_TIMEOUT_S)
GRACEFUL_SHUTDOWN_TIMEOUT_S = 30.0


class AppArgs(BaseModel):
    """The `args` of the config's application."""

    model_config = ConfigDict(extra="forbid")

    repository: str = Field("model_repository", description="the model repository, as TSERVE_REPOSITORY")
    intra_op_threads: int = Field(1, ge=1, description="ONNX Runtime's threads per replica = its num_cpus")
    settings: dict[str, Any] = Field(default_factory=dict,  # validated by the service's Settings, in the replica
                                     description="any other service setting by field name, as TSERVE_<NAME> would")
    min_replicas: int = Field(MIN_REPLICAS, ge=0)
    max_replicas: int = Field(MAX_REPLICAS, ge=1)
    target_ongoing_requests: float = Field(TARGET_ONGOING_REQUESTS, gt=0)
    max_ongoing_requests: int = Field(MAX_ONGOING_REQUESTS, ge=1)
    upscale_delay_s: float = Field(UPSCALE_DELAY_S, ge=0)
    downscale_delay_s: float = Field(DOWNSCALE_DELAY_S, ge=0)
    look_back_period_s: float = Field(LOOK_BACK_PERIOD_S, gt=0)

    def service_settings(self) -> dict[str, Any]:
        """The replica's service settings: the repository given here and no gRPC port (several replicas may share a
        node, and Ray's proxy carries HTTP only), unless `settings` says otherwise; the threads always these, which
        are also the replica's num_cpus."""
        return {"repository": self.repository, "grpc_port": 0, **self.settings,
                "intra_op_threads": self.intra_op_threads}

    def autoscaling_config(self) -> dict:
        return {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests, "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s, "metrics_interval_s": METRICS_INTERVAL_S,
                "look_back_period_s": self.look_back_period_s}


@serve.deployment(name=DEPLOYMENT, graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_TIMEOUT_S)
@serve.ingress()  # late-bound: the app is built in the replica, by __serve_build_asgi_app__, from its settings
class ServiceReplica:
    """One replica: a complete service process (`service.app.create_app`), its lifespan run by Serve."""

    def __init__(self, settings: dict[str, Any]):
        self._settings = settings
        self._app = None
        self._loaded = False

    def __serve_build_asgi_app__(self):
        from service.app import create_app  # in the replica: the driver that builds the application needs no models
        from service.observability.logs import configure_logging
        from service.settings import Settings

        settings = Settings(**self._settings)  # TSERVE_* variables of the replica's environment fill in the rest
        configure_logging(settings.log_level, settings.log_format)
        self._app = create_app(settings)
        return self._app

    async def check_health(self) -> None:
        """Ray's health check: the first waits for the models to load; after that, every configured model loaded
        and the process not draining (the service's /health/ready), or Ray replaces the replica."""
        registry = self._app.state.registry
        if not self._loaded:
            deadline = time.monotonic() + LOAD_TIMEOUT_S
            while registry.pending and time.monotonic() < deadline:
                await asyncio.sleep(LOAD_POLL_S)
            self._loaded = True
        ready, reasons = registry.readiness()
        if not ready:
            raise RuntimeError(f"replica pid {os.getpid()} not ready: {'; '.join(reasons)}")


def build_app(args: dict) -> Application:
    """The application `serve run` / `serve deploy` build from the config's import path and args (validated here
    as `AppArgs`: an unknown or invalid argument fails the deploy before any replica starts)."""
    args = AppArgs.model_validate(args)
    return ServiceReplica.options(
        ray_actor_options={"num_cpus": args.intra_op_threads},
        autoscaling_config=args.autoscaling_config(),
        max_ongoing_requests=args.max_ongoing_requests,
    ).bind(args.service_settings())
