"""Request messages that do not decode, answered INVALID_ARGUMENT with one log line (grpcio's own answer is UNKNOWN,
with the parser's traceback logged as an unexpected error of the servicer).

grpcio parses a request before any servicer code runs. `DecodeGuard`, a server interceptor for every service of the
server, wraps each method's deserializer: a message protobuf cannot parse (bytes that are no message, a message cut
short, a string field that is not UTF-8, nesting past protobuf's depth limit) becomes an `Undecodable` in its place.
- A unary call (and a server-streaming one: `grpc.health.v1`'s Watch) is refused before its method runs: for
  `inference.GRPCInferenceService` through `Calls.refuse` (its API key checked first, its access line with status
  400), for the open health service with a warning line of its own.
- In `ModelStreamInfer` an undecodable message is one request's error (`error_message`, as any bad request's); the
  stream goes on: the messages are framed by gRPC, so the next one is read as usual.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from service.api.oip.grpc.calls import SERVICE, Calls

log = logging.getLogger(__name__)

WHY = "bytes that are no message, a message cut short, a string that is not UTF-8, or nesting too deep"


@dataclass(frozen=True)
class Undecodable:
    """What took the place of a request message that did not parse: why, as the client is told."""

    message: str


def _tolerant(deserializer):
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except (DecodeError, RecursionError) as error:
            return Undecodable(f"the request is not a valid protobuf message: {error} ({len(data)} bytes; what "
                               f"protobuf refuses: {WHY})")
    return deserialize


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Every method's deserializer made tolerant; a unary request that did not decode refused before its method."""

    def __init__(self, calls: Calls):
        self.calls = calls
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}  # by method path: the services are fixed at start

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if (guarded := self._handlers.get(details.method)) is not None:
            return guarded
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        guarded = handler._replace(request_deserializer=_tolerant(handler.request_deserializer))
        for kind in ("unary_unary", "unary_stream"):  # a stream of requests reads each message itself
            if (behaviour := getattr(handler, kind)) is not None:
                guarded = guarded._replace(**{kind: self._guarded(details.method, behaviour)})
        self._handlers[details.method] = guarded
        return guarded

    async def _refuse(self, path: str, context: grpc.aio.ServicerContext, request: Undecodable) -> None:
        service, _, method = path.strip("/").partition("/")
        if service == SERVICE:
            await self.calls.refuse(context, method, request.message)
        log.warning("refused %s: %s", path, request.message)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)

    def _guarded(self, path: str, behaviour):
        """`behaviour`, unless its request did not decode; of the same kind (a coroutine or an async generator)."""
        if inspect.isasyncgenfunction(behaviour):
            async def streamed(request, context):
                if isinstance(request, Undecodable):
                    await self._refuse(path, context, request)
                async for response in behaviour(request, context):
                    yield response
            return streamed

        async def answered(request, context):
            if isinstance(request, Undecodable):
                await self._refuse(path, context, request)
            return await behaviour(request, context)
        return answered
