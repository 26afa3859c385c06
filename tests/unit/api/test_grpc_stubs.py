"""The committed gRPC stubs (`service/api/oip/grpc/generated`) are what `make proto` generates from the vendored
upstream protos with the locked grpcio-tools: a proto or a tools version that changed without `make proto` fails
here, naming the files that differ. And the protos are upstream's: the service and the messages tritonclient uses
are there under their upstream names."""

from __future__ import annotations

from service.api.oip.grpc import protos
from service.api.oip.grpc.generated import grpc_service_pb2 as pb


def test_the_committed_stubs_equal_freshly_generated_ones():
    assert protos.differences() == [], "run `make proto` and commit service/api/oip/grpc/generated"


def test_the_service_has_the_protocols_rpcs_under_upstreams_names():
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert service.full_name == "inference.GRPCInferenceService"
    methods = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    for unary in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
                  "ModelConfig", "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad",
                  "RepositoryModelUnload"):
        assert methods[unary] == (False, False), unary
    assert methods["ModelStreamInfer"] == (True, True)
