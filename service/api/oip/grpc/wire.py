"""What the server and its gRPC clients (the load test, the HTTP benchmark) share of the messages, the generated
stubs only besides: a request parameter as an `InferParameter`, and Triton's flag on a stream's last response. The
load generator's image copies this file (deploy/Dockerfile.locust)."""

from __future__ import annotations

from typing import Any

from service.api.oip.grpc.generated import grpc_service_pb2 as pb

# Triton's decoupled responses (ModelStreamInfer): the last response of a request says it is the last
FINAL_RESPONSE = "triton_final_response"


def to_parameter(value: Any) -> pb.InferParameter:
    """A JSON value (bool, int, float; anything else as its string) as an InferParameter."""
    if isinstance(value, bool):
        return pb.InferParameter(bool_param=value)
    if isinstance(value, int):
        return pb.InferParameter(int64_param=value)
    if isinstance(value, float):
        return pb.InferParameter(double_param=value)
    return pb.InferParameter(string_param=str(value))
