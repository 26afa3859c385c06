"""gRPC against inputs nobody sends on purpose (issue 51): every method answers every failure with the right status
code and a bounded message, and logs it as one line: no model name (INVALID_ARGUMENT naming the field), a name or a
parameter key of megabytes (NOT_FOUND or INVALID_ARGUMENT, the echo cut to `MAX_MESSAGE_BYTES`), messages that do
not decode (INVALID_ARGUMENT, no traceback); a translation streamed without `num_beams` is its beam search's one
result, as on ModelInfer; and grpcio's record of a send to a client that had closed the call is one info line.
"""

from __future__ import annotations

import logging
import queue

import grpc
import pytest
import tritonclient.grpc as tgrpc
from grpc_health.v1 import health_pb2
from tritonclient.utils import InferenceServerException

from service.api.fields import MAX_NAME_CHARS
from service.api.oip.grpc.calls import MAX_MESSAGE_BYTES
from service.api.oip.grpc.generated import grpc_service_pb2 as pb
from service.api.oip.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from service.client.processes import free_port
from tests.support.triton_inputs import grpc_text_input as text_input
from tests.support.waiting import PATIENCE_S, poll

pytestmark = pytest.mark.slow

SERVICE = "/inference.GRPCInferenceService"
CALL_TIMEOUT_S = 60.0  # a unary call on a busy 2-core machine
STREAM_WAIT_S = 30.0  # how long a test waits for the next streamed response
HUGE = 1_000_000  # characters of a name a client should never send: over the metadata limit if echoed
# a request message that is no protobuf message, or not the one it should be: protobuf's parser refuses each
UNDECODABLE = {
    "garbage": b"\xff" * 50,
    "truncated": pb.ModelInferRequest(model_name="gpt", id="x" * 40).SerializeToString()[:20],
    "not UTF-8": b"\x0a\x02\xc3\x28",  # model_name (field 1), 2 bytes that are no UTF-8
    "nested": b"\x9b\x06" * 100_000,  # field 99 opens a group inside a group, 100,000 deep
}


@pytest.fixture(scope="module")
def server(server_factory):
    with server_factory("grpc hostile", grpc_port=free_port()) as process:
        yield process


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.knobs['TSERVE_GRPC_PORT']}") as c:
        yield c


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="module")
def client(server):
    c = tgrpc.InferenceServerClient(f"127.0.0.1:{server.knobs['TSERVE_GRPC_PORT']}")
    yield c
    c.close()


def prompt_request(model: str, **parameters) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name=model)
    message.inputs.add(name="PROMPT", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"ROMEO:\n")
    for key, value in parameters.items():
        message.parameters[key].int64_param = value
    return message


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value


def stream(client, requests: list[dict]) -> list[tuple]:
    """(result, error) for each request sent on one ModelStreamInfer, in the order they came."""
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for request in requests:
            client.async_stream_infer(**request)
        return [responses.get(timeout=STREAM_WAIT_S) for _ in requests]
    finally:
        client.stop_stream()


def errors_logged(server) -> list[dict]:
    """The server's log records at error level or with a traceback."""
    return [r for r in server.log_records() if r.get("level") in ("error", "critical") or "exception" in r]


def test_no_model_name_is_invalid_argument_naming_the_field(client, stub):
    for call, field in [(lambda: client.is_model_ready(""), "name"),
                        (lambda: client.get_model_metadata(""), "name"),
                        (lambda: client.get_model_config(""), "name"),
                        (lambda: client.infer("", [text_input("PROMPT", ["x"])]), "model_name")]:
        with pytest.raises(InferenceServerException) as refused:
            call()
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT", refused.value
        assert f"{field} is empty" in refused.value.message()
    empty = refusal(lambda: stub.ModelInfer(pb.ModelInferRequest(), timeout=CALL_TIMEOUT_S))
    assert empty.code() == grpc.StatusCode.INVALID_ARGUMENT and "model_name is empty" in empty.details()
    (unnamed, named) = stream(client, [
        {"model_name": "", "inputs": [text_input("PROMPT", ["x"])], "request_id": "unnamed"},
        {"model_name": "gpt", "inputs": [text_input("PROMPT", ["x"])], "request_id": "named",
         "parameters": {"max_new_tokens": 1}}])
    assert unnamed[0] is None and "model_name is empty" in unnamed[1].message()
    assert named[1] is None and named[0].get_response().id == "named"  # the stream went on


def test_a_huge_name_or_key_is_answered_with_a_bounded_message(client, stub, channel):
    for length in (10_000, HUGE):
        name = "m" * length
        unknown = refusal(lambda: stub.ModelInfer(prompt_request(name), timeout=CALL_TIMEOUT_S))
        assert unknown.code() == grpc.StatusCode.NOT_FOUND, unknown
        assert name[:MAX_NAME_CHARS] in unknown.details() and len(unknown.details().encode()) <= MAX_MESSAGE_BYTES
        metadata = refusal(lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name=name), timeout=CALL_TIMEOUT_S))
        assert metadata.code() == grpc.StatusCode.NOT_FOUND, metadata
        assert not stub.ModelReady(pb.ModelReadyRequest(name=name), timeout=CALL_TIMEOUT_S).ready
    for key in ("k" * 100_000, "é" * 50_000):  # a key's echo percent-encoded: 3 bytes per byte of UTF-8
        keyed = refusal(lambda: stub.ModelInfer(prompt_request("gpt", **{key: 1}), timeout=CALL_TIMEOUT_S))
        assert keyed.code() == grpc.StatusCode.INVALID_ARGUMENT, keyed
        assert key[:100] in keyed.details() and len(keyed.details().encode()) <= MAX_MESSAGE_BYTES
    health = channel.unary_unary("/grpc.health.v1.Health/Check",
                                 request_serializer=health_pb2.HealthCheckRequest.SerializeToString)
    service = refusal(lambda: health(health_pb2.HealthCheckRequest(service="s" * HUGE), timeout=CALL_TIMEOUT_S))
    assert service.code() == grpc.StatusCode.NOT_FOUND and len(service.details().encode()) <= MAX_MESSAGE_BYTES
    ((result, error),) = stream(client, [{"model_name": "m" * HUGE, "inputs": [text_input("PROMPT", ["x"])]}])
    assert result is None and "not found" in error.message() and len(error.message().encode()) <= MAX_MESSAGE_BYTES


@pytest.mark.parametrize("kind", UNDECODABLE)
def test_a_message_that_does_not_decode_is_invalid_argument_and_one_log_line(server, channel, kind):
    data = UNDECODABLE[kind]
    request_id = f"undecodable-{kind.replace(' ', '-')}"
    for path in (f"{SERVICE}/ModelInfer", f"{SERVICE}/ModelReady", "/grpc.health.v1.Health/Check"):
        raw = channel.unary_unary(path)  # no serializers: the bytes go as they are
        refused = refusal(lambda: raw(data, timeout=CALL_TIMEOUT_S, metadata=(("x-request-id", request_id),)))
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, refused)
        assert "not a valid protobuf message" in refused.details()
    access = poll(lambda: server.access_records(request_id), timeout=PATIENCE_S, message="the access lines")
    assert {r["status"] for r in access} == {400}
    # on a stream, that message is one request's error and the next request is answered
    answers = channel.stream_stream(f"{SERVICE}/ModelStreamInfer")(
        iter([data, prompt_request("gpt", max_new_tokens=1).SerializeToString()]), timeout=CALL_TIMEOUT_S)
    first, *rest = [pb.ModelStreamInferResponse.FromString(answer) for answer in answers]
    assert "not a valid protobuf message" in first.error_message
    assert rest and not any(r.error_message for r in rest)
    assert errors_logged(server) == []


def test_the_health_watch_refuses_an_undecodable_request(channel):
    watch = channel.unary_stream("/grpc.health.v1.Health/Watch")
    refused = refusal(lambda: next(watch(UNDECODABLE["garbage"], timeout=CALL_TIMEOUT_S)))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT, refused
    check = channel.unary_unary("/grpc.health.v1.Health/Check", response_deserializer=
                                health_pb2.HealthCheckResponse.FromString)
    assert check(health_pb2.HealthCheckRequest().SerializeToString(), timeout=CALL_TIMEOUT_S).status == \
        health_pb2.HealthCheckResponse.SERVING


def test_a_translation_streamed_without_num_beams_is_its_beam_searchs_one_result(client):
    text = [text_input("TEXT", ["Ein Mann fährt Fahrrad."])]
    ((result, error),) = stream(client, [{"model_name": "translation", "inputs": text}])
    assert error is None, error
    assert result.get_response().parameters["triton_final_response"].bool_param  # one response: the whole result
    unary = client.infer("translation", text)
    assert result.as_numpy("TRANSLATION")[0] == unary.as_numpy("TRANSLATION")[0]
    assert result.as_numpy("SCORE")[0] == pytest.approx(unary.as_numpy("SCORE")[0], abs=1e-6)


def test_a_send_to_a_client_that_closed_the_call_is_one_info_line(caplog):
    """What grpcio logs when a client cancels a stream while a response is being sent (a race inside grpcio, which
    no client can be made to win): one line, and any other error of grpcio's as it was."""
    from grpc._cython.cygrpc import ExecuteBatchError

    from service.api.oip.grpc.server import GRPC_CORE_LOGGER, quiet_client_gone

    quiet_client_gone()
    logger = logging.getLogger(GRPC_CORE_LOGGER)
    with caplog.at_level(logging.INFO, logger=GRPC_CORE_LOGGER):
        for error in (ExecuteBatchError('Failed "execute_batch"'), ValueError("a fault of a servicer")):
            try:
                raise error
            except Exception:
                logger.exception("%s raised by servicer method [%s]", type(error).__name__, f"{SERVICE}/ModelInfer")
    gone, fault = [r for r in caplog.records if r.name == GRPC_CORE_LOGGER]
    assert gone.levelno == logging.INFO and gone.exc_info is None and "closed the call" in gone.getMessage()
    assert fault.levelno == logging.ERROR and fault.exc_info is not None
