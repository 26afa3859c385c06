"""The gRPC server: a `grpc.aio` server on TSERVE_GRPC_PORT (0: none), started in the app's lifespan on its event
loop, serving `inference.GRPCInferenceService` (`service.api.oip.grpc.servicer`) and the standard health service
`grpc.health.v1.Health` (Kubernetes' gRPC probes; open without an API key).

- Message sizes: a request of at most TSERVE_MAX_BODY_BYTES, as the REST body limit; a response too.
- A request message that does not parse is INVALID_ARGUMENT (`service.api.oip.grpc.undecodable`), for every service.
- A client that cancels a call while its response or status is being sent: grpcio may see the failed send before
  the cancel and log it as an error with a traceback (`ExecuteBatchError raised in core`, a race of its own);
  `ClientGone` makes that one info line.
- Health: SERVING while the registry is ready (every configured model loaded, not draining), else NOT_SERVING, for
  the server ("") and for `inference.GRPCInferenceService`; an unknown service is NOT_FOUND. Refreshed every
  `HEALTH_REFRESH_S` for `Watch`; `Check` reads the registry itself.
- Shutdown (`stop`): once SIGTERM has marked the registry draining and uvicorn has finished its HTTP requests, new
  calls are refused and the calls in flight get up to TSERVE_DRAIN_TIMEOUT_S to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from service.api.oip.grpc.calls import SERVICE, Calls, bounded
from service.api.oip.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from service.api.oip.grpc.servicer import InferenceServicer
from service.api.oip.grpc.undecodable import DecodeGuard
from service.http.auth import ApiKeys

log = logging.getLogger(__name__)

HEALTH_REFRESH_S = 1.0  # how often Watch's statuses follow the registry's readiness
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_SERVICES = ("", SERVICE)  # the server as a whole, and the inference service
GRPC_CORE_LOGGER = "grpc._cython.cygrpc"  # where grpcio's asyncio server logs what its methods' calls raised
SEND_FAILED = "ExecuteBatchError"  # grpcio's error for operations on a call that the client has already closed


class ClientGone(logging.Filter):
    """grpcio's record of a send that failed because the client had just closed the call (cancelled, or its
    deadline passed) as one info line, without the traceback: nothing of the service failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[0] if record.exc_info else None
        if error is not None and error.__name__ == SEND_FAILED:
            record.msg, record.args = f"{record.getMessage()}: the client closed the call first", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


def quiet_client_gone() -> None:
    """Install `ClientGone` on grpcio's logger (once)."""
    logger = logging.getLogger(GRPC_CORE_LOGGER)
    if not any(isinstance(f, ClientGone) for f in logger.filters):
        logger.addFilter(ClientGone())


class RegistryHealth(health.aio.HealthServicer):
    """grpc.health.v1 from the registry's readiness."""

    def __init__(self, registry):
        super().__init__()
        self.registry = registry

    def status(self):
        return SERVING if self.registry.readiness()[0] else NOT_SERVING

    async def refresh(self) -> None:
        for name in HEALTH_SERVICES:
            await self.set(name, self.status())

    async def Check(self, request, context):
        if request.service not in HEALTH_SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, bounded(f"unknown service {request.service!r}"))
        return health_pb2.HealthCheckResponse(status=self.status())


class GrpcServer:
    """The started server, its health service and the task that keeps Watch's statuses current."""

    def __init__(self, server: grpc.aio.Server, health_servicer: RegistryHealth, port: int):
        self.server, self.health, self.port = server, health_servicer, port
        self._refresher = asyncio.create_task(self._refresh_forever())

    async def _refresh_forever(self) -> None:
        while True:
            await self.health.refresh()
            await asyncio.sleep(HEALTH_REFRESH_S)

    async def stop(self, grace_s: float) -> None:
        self._refresher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._refresher
        await self.health.enter_graceful_shutdown()  # Watch and Check say NOT_SERVING from now on
        await self.server.stop(grace_s)
        log.info("gRPC server on port %d stopped", self.port)


async def start(app, keys: ApiKeys) -> GrpcServer | None:
    """Start serving gRPC for `app` on TSERVE_HOST:TSERVE_GRPC_PORT (None when the port is 0). A port that
    cannot be bound raises, so the app does not start half-way."""
    settings = app.state.settings
    if not settings.grpc_port:
        return None
    limit = settings.max_body_bytes
    quiet_client_gone()
    calls = Calls(app, keys)
    server = grpc.aio.server(interceptors=[DecodeGuard(calls)],
                             options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.max_send_message_length", limit),
                                      ("grpc.so_reuseport", 0)])  # a port another server listens on is in use
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(app, calls), server)
    health_servicer = RegistryHealth(app.state.registry)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    port = server.add_insecure_port(f"{host}:{settings.grpc_port}")  # raises RuntimeError when it cannot bind
    await server.start()
    log.info("gRPC (inference.GRPCInferenceService, grpc.health.v1) on %s:%d", settings.host, port)
    return GrpcServer(server, health_servicer, port)
