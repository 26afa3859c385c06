"""`inference.GRPCInferenceService` (the KServe v2 gRPC protocol with Triton's extensions, `proto/grpc_service.proto`)
over the same core as the REST routes: metadata and health from `service.api.oip.metadata`, inference through
`service.api.oip.inference` (the tensors mapped by `service.api.oip.grpc.tensors`), model control through
`service.models.control`, every call observed and its errors mapped by `service.api.oip.grpc.calls`.

`ModelStreamInfer` is Triton's decoupled streaming: requests on one stream run concurrently, their responses
interleaved, each carrying its request's `id`, the last of each with `triton_final_response` true. Shared memory,
trace and log settings are UNIMPLEMENTED with a message saying so: tensors travel in the messages.

Invariant: an error ends its request only (on a stream: a response with `error_message`, and the stream goes on);
cancelling the call cancels every request of it: their jobs, and their rows, are dropped at the next decoding step.

Design notes: docs/architecture.md, service/api/oip/grpc/servicer.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from google.protobuf import json_format

from service.api.control import requested_version
from service.api.fields import MAX_NAME_CHARS
from service.api.oip import inference as oip_inference
from service.api.oip import metadata
from service.api.oip.grpc import tensors as grpc_tensors
from service.api.oip.grpc.calls import (
    CANCELLED_STATUS,
    INTERNAL_MESSAGE,
    INTERNAL_STATUS,
    OK_STATUS,
    Calls,
    GrpcCall,
    bounded,
)
from service.api.oip.grpc.generated import grpc_service_pb2 as pb
from service.api.oip.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from service.api.oip.grpc.undecodable import Undecodable
from service.api.oip.protocol import InferenceRequest
from service.errors import BadInput, NotFound, NotImplementedHere, ServiceError, Unavailable
from service.serving.context import resolve

log = logging.getLogger(__name__)

NO_SHARED_MEMORY = "shared memory is not supported: tensors travel in the request and response messages"
NOT_IMPLEMENTED = {"SystemSharedMemoryStatus": NO_SHARED_MEMORY, "SystemSharedMemoryRegister": NO_SHARED_MEMORY,
                   "SystemSharedMemoryUnregister": NO_SHARED_MEMORY, "CudaSharedMemoryStatus": NO_SHARED_MEMORY,
                   "CudaSharedMemoryRegister": NO_SHARED_MEMORY, "CudaSharedMemoryUnregister": NO_SHARED_MEMORY,
                   "TraceSetting": "trace settings are not supported: tracing is configured by OTEL_* variables",
                   "LogSettings": "log settings are not supported: logging is configured by TSERVE_LOG_*"}
READY = "READY"  # a repository index entry's state for a loaded version


def model_name(name: str, field: str) -> str:
    """The model a request names in its `field`: 400 naming the field when it is empty, 404 when it is longer than
    any model's name may be (only its start quoted: the status message must stay small)."""
    if not name:
        raise BadInput(f"{field} is empty: name a model", param=field)
    if len(name) > MAX_NAME_CHARS:
        raise NotFound(f"model {name[:MAX_NAME_CHARS]!r}... not found: its {field} has {len(name)} characters, a "
                       f"model's name at most {MAX_NAME_CHARS}", param=field)
    return name


def _message(response, payload: dict):
    """A response message read from the protocol's JSON object (the REST routes' very object)."""
    return json_format.ParseDict(payload, response, ignore_unknown_fields=True)


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, app, calls: Calls):
        self.app, self.calls = app, calls

    @property
    def registry(self):
        return self.app.state.registry

    # --- health and metadata -------------------------------------------------------------------------------------

    async def ServerLive(self, request, context):
        return await self.calls.unary(context, "ServerLive", self._live)

    async def _live(self, call: GrpcCall):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        async def work(call):
            return pb.ServerReadyResponse(ready=self.registry.readiness()[0])
        return await self.calls.unary(context, "ServerReady", work)

    async def ModelReady(self, request, context):
        async def work(call):
            version = metadata.parse_version(request.version)  # INVALID_ARGUMENT for a version that is no number
            try:
                self.registry.resolve(None, model_name(request.name, "name"), version)
            except (NotFound, Unavailable):
                return pb.ModelReadyResponse(ready=False)
            return pb.ModelReadyResponse(ready=True)
        return await self.calls.unary(context, "ModelReady", work)

    async def ServerMetadata(self, request, context):
        async def work(call):
            return _message(pb.ServerMetadataResponse(), metadata.server_metadata())
        return await self.calls.unary(context, "ServerMetadata", work)

    async def ModelMetadata(self, request, context):
        async def work(call):
            loaded = metadata.resolve(self.registry, model_name(request.name, "name"), request.version)
            return _message(pb.ModelMetadataResponse(), metadata.model_metadata(self.registry, loaded))
        return await self.calls.unary(context, "ModelMetadata", work)

    async def ModelConfig(self, request, context):
        async def work(call):
            loaded = metadata.resolve(self.registry, model_name(request.name, "name"), request.version)
            return _message(pb.ModelConfigResponse(), {"config": metadata.configuration(self.registry, loaded)})
        return await self.calls.unary(context, "ModelConfig", work)

    async def ModelStatistics(self, request, context):
        async def work(call):
            name = request.name and model_name(request.name, "name")  # none: every model's
            stats = metadata.statistics(self.registry, self.app.state.metrics, name, request.version)
            return _message(pb.ModelStatisticsResponse(), stats)
        return await self.calls.unary(context, "ModelStatistics", work)

    # --- model repository (Triton's extension; load and unload only with TSERVE_MODEL_CONTROL) -------------------

    async def RepositoryIndex(self, request, context):
        async def work(call):
            entries = self.app.state.model_control.index()
            if request.ready:
                entries = [e for e in entries if e["state"] == READY]
            return _message(pb.RepositoryIndexResponse(), {"models": entries})
        return await self.calls.unary(context, "RepositoryIndex", work)

    async def RepositoryModelLoad(self, request, context):
        return await self._control(context, "RepositoryModelLoad", request, self.app.state.model_control.load,
                                   pb.RepositoryModelLoadResponse())

    async def RepositoryModelUnload(self, request, context):
        return await self._control(context, "RepositoryModelUnload", request, self.app.state.model_control.unload,
                                   pb.RepositoryModelUnloadResponse())

    async def _control(self, context, method: str, request, act, response):
        """`act(name, version)` (load or unload) for the version the request's parameters name, as REST does."""
        async def work(call):
            self.app.state.model_control.check_enabled()  # PERMISSION_DENIED before anything of the request is read
            name = model_name(request.model_name, "model_name")
            await act(name, requested_version(grpc_tensors.parameters_of(request.parameters)))
            return response
        return await self.calls.unary(context, method, work)

    # --- inference -----------------------------------------------------------------------------------------------

    async def ModelInfer(self, request, context):
        async def work(call: GrpcCall):
            loaded = resolve(call, None, model_name(request.model_name, "model_name"),
                             metadata.parse_version(request.model_version))
            inference, tensors = grpc_tensors.parse_request(request)
            outputs = await oip_inference.infer(call, loaded, inference, tensors, set(), call.remaining_ms())
            return grpc_tensors.infer_response(loaded.name, loaded.version, inference, outputs)
        return await self.calls.unary(context, "ModelInfer", work, counted=True)

    async def ModelStreamInfer(self, request_iterator, context) -> AsyncIterator[pb.ModelStreamInferResponse]:
        try:
            self.calls.authorize(context)
        except ServiceError as error:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, bounded(error.message))
        responses: asyncio.Queue = asyncio.Queue()
        running: set[asyncio.Task] = set()
        done = object()

        async def answer(message: pb.ModelInferRequest) -> None:
            async for response in self._stream_one(context, message):
                await responses.put(response)

        async def read() -> None:
            try:
                async for message in request_iterator:
                    task = asyncio.create_task(answer(message))
                    running.add(task)
                    task.add_done_callback(running.discard)
                while running:  # the client has sent everything: answer it all, then end the call
                    await asyncio.gather(*running, return_exceptions=True)
            finally:
                responses.put_nowait(done)  # also when reading failed: the call ends rather than waits

        reader = asyncio.create_task(read())
        try:
            while (response := await responses.get()) is not done:
                yield response
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()  # the call ended early (cancelled, or the client went away): drop their jobs

    async def _stream_one(self, context, message: pb.ModelInferRequest | Undecodable,
                          ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """The responses of one request of a stream (see the module's docstring)."""
        call, span, started = self.calls.begin(context, "ModelStreamInfer")
        status, failure, inference = INTERNAL_STATUS, None, None
        try:
            if isinstance(message, Undecodable):
                undecodable, message = message, pb.ModelInferRequest()  # its error can name no request
                raise BadInput(undecodable.message)
            loaded = resolve(call, None, model_name(message.model_name, "model_name"),
                             metadata.parse_version(message.model_version))
            inference, tensors = grpc_tensors.parse_request(message)
            empty_final = inference.parameters.get(grpc_tensors.EMPTY_FINAL_RESPONSE, False)
            remaining = call.remaining_ms()
            if oip_inference.streams(call, loaded, inference, tensors):
                async for outputs, final in oip_inference.stream(call, loaded, inference, tensors, remaining):
                    yield self._response(loaded, inference, outputs, final and not empty_final)
            else:
                outputs = await oip_inference.infer(call, loaded, inference, tensors, set(), remaining)
                yield self._response(loaded, inference, outputs, not empty_final)
            if empty_final:
                yield pb.ModelStreamInferResponse(
                    infer_response=grpc_tensors.empty_final_response(loaded.name, loaded.version, inference))
            status = OK_STATUS
        except ServiceError as error:
            status, failure = error.status, error
            call.state.failure_reason = error.reason
            yield self._error(message, error.message)
        except asyncio.CancelledError as error:
            status, failure = CANCELLED_STATUS, error
            raise
        except Exception as error:
            failure = error
            log.exception("unhandled error in ModelStreamInfer")
            yield self._error(message, INTERNAL_MESSAGE)
        finally:
            self.calls.end(call, span, started, "ModelStreamInfer", True, status, failure)

    @staticmethod
    def _response(loaded, inference: InferenceRequest, outputs, final: bool) -> pb.ModelStreamInferResponse:
        return pb.ModelStreamInferResponse(infer_response=grpc_tensors.infer_response(
            loaded.name, loaded.version, inference, outputs, final=final))

    @staticmethod
    def _error(message: pb.ModelInferRequest, text: str) -> pb.ModelStreamInferResponse:
        """A stream request's error: its message, and its id so the client can tell which request failed."""
        return pb.ModelStreamInferResponse(error_message=bounded(text), infer_response=pb.ModelInferResponse(
            model_name=message.model_name[:MAX_NAME_CHARS], model_version=message.model_version[:MAX_NAME_CHARS],
            id=message.id))


def _not_implemented(method: str, why: str):
    async def handler(self, request, context):
        async def work(call):
            raise NotImplementedHere(why)  # UNIMPLEMENTED, logged as 501 (an abort here would be logged as a 500)
        return await self.calls.unary(context, method, work)
    handler.__name__ = method
    return handler


for _method, _why in NOT_IMPLEMENTED.items():
    setattr(InferenceServicer, _method, _not_implemented(_method, _why))
