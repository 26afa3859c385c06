"""The load test's gRPC calls (the Open Inference Protocol's `inference.GRPCInferenceService`, as tritonclient.grpc
makes them), after locust's documented gRPC pattern: a grpc channel made cooperative with gevent
(`grpc.experimental.gevent.init_gevent`, before any channel exists), and each call's outcome fired as a locust
request event (`request_type` "grpc"), so gRPC shares the statistics, the CSV files and the failure list with HTTP.

- `grpc classify`: `ModelInfer` of 1..N PNG files as the raw BYTES input `IMAGE`; checked: PROBABILITIES of shape
  (images, classes) and a LABEL per image.
- `grpc generate stream`: `ModelStreamInfer` of one prompt (sampled, as `generate stream`); its response time is
  the whole stream, to the response flagged `triton_final_response`; its time to first token at the first
  response; checked: no error message, a FINISH_REASON on the last response only, at most max_new_tokens bytes.

Target: TSERVE_LOAD_GRPC_HOST (host:port), default the HTTP host's name at port 8001 (nginx's and the service's
gRPC port); the API key, when set, travels as `authorization: Bearer` metadata.
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import grpc
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any channel: gRPC's I/O yields to gevent, as locust's users need

from load_checks import CLASSES, Unexpected, expect  # noqa: E402 - after init_gevent

from service.api.oip.binary import pack_bytes, unpack_bytes  # noqa: E402
from service.api.oip.grpc.generated import grpc_service_pb2 as pb  # noqa: E402
from service.api.oip.grpc.generated import grpc_service_pb2_grpc as pb_grpc  # noqa: E402
from service.api.oip.grpc.wire import FINAL_RESPONSE, to_parameter  # noqa: E402

GRPC_PORT = 8001  # TSERVE_GRPC_PORT's default, and nginx's gRPC port
STREAM_TIMEOUT_S = 130.0  # as nginx's grpc_read_timeout: past the service's longest deadline


def default_target(http_host: str) -> str:
    """host:8001 of locust's --host (http://host:port)."""
    return f"{urlsplit(http_host).hostname or '127.0.0.1'}:{GRPC_PORT}"


def outputs_of(response: pb.ModelInferResponse) -> dict[str, tuple[list[int], bytes]]:
    """name -> (shape, raw data) of a response's outputs."""
    return {o.name: (list(o.shape), raw) for o, raw in zip(response.outputs, response.raw_output_contents)}


class GrpcInference:
    """One user's channel and calls; `fire(name, started, length, exception)` reports a call to locust."""

    def __init__(self, target: str, api_key: str | None, fire):
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.fire = fire

    def close(self) -> None:
        self.channel.close()

    def classify(self, pngs: list[bytes]) -> int | None:
        """The images classified, or None (the failure is reported)."""
        request = pb.ModelInferRequest(model_name="vit")
        request.inputs.add(name="IMAGE", datatype="BYTES", shape=[len(pngs)])
        request.raw_input_contents.append(pack_bytes(pngs))
        started = time.perf_counter()
        try:
            response = self.stub.ModelInfer(request, metadata=self.metadata, timeout=STREAM_TIMEOUT_S)
            outputs = outputs_of(response)
            expect(outputs["PROBABILITIES"][0] == [len(pngs), CLASSES], "PROBABILITIES shape")
            expect(len(unpack_bytes(outputs["LABEL"][1])) == len(pngs), "LABEL")
        except (grpc.RpcError, Unexpected, KeyError) as error:
            self.fire("grpc classify", started, 0, error)
            return None
        self.fire("grpc classify", started, response.ByteSize(), None)
        return len(pngs)

    def generate_stream(self, prompt: str, options: dict, max_new_tokens: int) -> tuple[int, float] | None:
        """(tokens generated, ms to the first response) of a streamed generation, or None (reported)."""
        request = pb.ModelInferRequest(model_name="gpt", id="load")
        request.inputs.add(name="PROMPT", datatype="BYTES", shape=[1])
        request.raw_input_contents.append(pack_bytes([prompt.encode()]))
        for key, value in {**options, "max_new_tokens": max_new_tokens}.items():
            request.parameters[key].CopyFrom(to_parameter(value))
        started, first_ms, text, length, final = time.perf_counter(), None, b"", 0, False
        try:
            for answer in self.stub.ModelStreamInfer(iter([request]), metadata=self.metadata,
                                                     timeout=STREAM_TIMEOUT_S):
                length += answer.ByteSize()
                if answer.error_message:
                    raise Unexpected(f"error message: {answer.error_message}")
                if first_ms is None:
                    first_ms = (time.perf_counter() - started) * 1000
                outputs = outputs_of(answer.infer_response)
                final = answer.infer_response.parameters[FINAL_RESPONSE].bool_param
                expect(("FINISH_REASON" in outputs) == final, "FINISH_REASON on the last response only")
                text += b"".join(unpack_bytes(outputs["TEXT"][1]))
                if final:
                    break
            expect(final, "a response flagged triton_final_response")
            expect(len(text) <= max_new_tokens, "at most max_new_tokens bytes (byte-level tokens)")
        except (grpc.RpcError, Unexpected, KeyError) as error:
            self.fire("grpc generate stream", started, length, error)
            return None
        self.fire("grpc generate stream", started, length, None)
        return len(text), first_ms
