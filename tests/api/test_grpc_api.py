"""The Open Inference Protocol over gRPC proven with the real `tritonclient.grpc` (sync, aio and `stream_infer`)
against a real server on the tiny models: health (the protocol's and `grpc.health.v1`), server and model metadata,
model configuration and statistics (equal to REST's), inference for all three models with raw and typed tensor
contents (equal to REST's results), requested outputs and classification, streaming generation whose text equals
the REST and SSE texts for the same greedy request, and tables of the error, deadline, overload, cancellation,
auth and message-size cases; a SIGTERM turns the gRPC health NOT_SERVING and lets a call in flight finish.
"""

from __future__ import annotations

import asyncio
import json
import queue
import signal
import threading
import time

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.grpc.aio as tgrpc_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from service.api.oip.grpc.generated import grpc_service_pb2 as pb
from service.api.oip.grpc.generated import grpc_service_pb2_grpc as pb_grpc
from service.client.processes import free_port
from service.client.sse import parse_sse
from tests.support.images import png_bytes
from tests.support.metrics import metric, scrape
from tests.support.triton_inputs import grpc_text_input as text_input
from tests.support.waiting import PATIENCE_S, poll

pytestmark = pytest.mark.slow

GERMAN = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee."]
GREEDY = {"max_new_tokens": 40, "temperature": 0}
API_KEY = "grpc-test-key-0123456789"
STREAM_WAIT_S = 30.0  # how long a test waits for the next streamed response (a busy 2-core machine)
# a translation long enough to be in flight when the client gives up: 32 sentences of 120 tokens each, beam 8
HEAVY_TEXTS = GERMAN * 16
HEAVY = {"num_beams": 8, "max_new_tokens": 120, "min_new_tokens": 120}


@pytest.fixture(scope="module")
def server(server_factory):
    with server_factory("grpc server", grpc_port=free_port(), max_new_tokens=HEAVY["max_new_tokens"]) as process:
        yield process


def grpc_url(process) -> str:
    return f"127.0.0.1:{process.knobs['TSERVE_GRPC_PORT']}"


@pytest.fixture(scope="module")
def client(server):
    c = tgrpc.InferenceServerClient(grpc_url(server))
    yield c
    c.close()


@pytest.fixture(scope="module")
def rest(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(grpc_url(server)) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="module")
def images(data_dir) -> np.ndarray:
    from models.data import load_fashion_mnist

    return load_fashion_mnist(data_dir, "test")[0][:4]  # (4, 28, 28) uint8


def strings(array) -> list[str]:
    return [x.decode() for x in array.reshape(-1)]


# --- health and metadata --------------------------------------------------------------------------------------


def test_health_metadata_and_configuration_equal_rest(client, rest):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("gpt") and client.is_model_ready("vit", "1")
    assert not client.is_model_ready("nope") and not client.is_model_ready("gpt", "9")
    assert client.get_server_metadata(as_json=True) == rest.get("/v2").json()
    for model in ("vit", "translation", "gpt"):
        metadata = client.get_model_metadata(model, as_json=True)
        for tensor in metadata["inputs"] + metadata["outputs"]:
            tensor["shape"] = [int(d) for d in tensor["shape"]]  # protobuf's JSON writes int64 as strings
        assert metadata == rest.get(f"/v2/models/{model}").json()
        config = client.get_model_config(model, as_json=True)["config"]
        expected = rest.get(f"/v2/models/{model}/config").json()
        # protobuf's JSON writes int64 as strings and leaves out defaults: compare what both state
        assert config["name"] == expected["name"] and config["platform"] == expected["platform"]
        assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config["input"]] == \
            [(t["name"], t["data_type"], t["dims"]) for t in expected["input"]]
        assert [t["name"] for t in config["output"]] == [t["name"] for t in expected["output"]]
        assert config["parameters"] == expected["parameters"]


def test_grpc_health_service_follows_readiness_and_needs_no_key(server):
    with grpc.insecure_channel(grpc_url(server)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_statistics_count_each_grpc_request_once(client, rest):
    def success(stats):
        return int(stats["model_stats"][0]["inference_stats"]["success"].get("count", 0))

    before = success(client.get_inference_statistics("gpt", as_json=True))
    client.infer("gpt", [text_input("PROMPT", ["ROMEO:\n"])], parameters={"max_new_tokens": 3})
    after = client.get_inference_statistics("gpt", as_json=True)
    assert success(after) == before + 1
    assert success(after) == rest.get("/v2/models/gpt/stats").json()["model_stats"][0]["inference_stats"][
        "success"]["count"]
    samples = scrape(rest)
    assert metric(samples, "tserve_request_duration_seconds_count", api="oip-grpc", endpoint="ModelInfer",
                  model="gpt", status="200") >= 1


# --- inference --------------------------------------------------------------------------------------------------


def test_vit_images_and_pixels_give_rests_probabilities(client, rest, images):
    files = [png_bytes(image) for image in images]
    encoded = tgrpc.InferInput("IMAGE", [len(files)], "BYTES")
    encoded.set_data_from_numpy(np.array(files, dtype=object))
    pixels = tgrpc.InferInput("PIXELS", list(images.shape), "FP32")
    pixels.set_data_from_numpy(images.astype(np.float32) / 255.0)
    from_files = client.infer("vit", [encoded])
    from_pixels = client.infer("vit", [pixels]).as_numpy("PROBABILITIES")
    native = rest.post("/v1/classify", files=[("files", (f"{i}.png", f)) for i, f in enumerate(files)],
                       data={"top_k": "10"}).json()["predictions"]
    probabilities = from_files.as_numpy("PROBABILITIES")
    assert probabilities.shape == (len(files), 10) and probabilities.dtype == np.float32
    for row, predictions in zip(probabilities, native):
        for p in predictions:
            assert row[p["index"]] == pytest.approx(p["score"], abs=1e-6)
    np.testing.assert_allclose(from_pixels, probabilities, atol=1e-6)
    assert strings(from_files.as_numpy("LABEL")) == [p[0]["label"] for p in native]


def test_classification_and_requested_outputs(client, images):
    encoded = tgrpc.InferInput("IMAGE", [2], "BYTES")
    encoded.set_data_from_numpy(np.array([png_bytes(image) for image in images[:2]], dtype=object))
    result = client.infer("vit", [encoded], outputs=[tgrpc.InferRequestedOutput("PROBABILITIES", class_count=3)])
    top = result.as_numpy("PROBABILITIES")
    assert top.shape == (2, 3) and result.as_numpy("LABEL") is None
    scores = [float(entry.decode().split(":")[0]) for entry in top[0]]
    assert scores == sorted(scores, reverse=True) and 0 < scores[0] <= 1


def test_typed_contents_equal_raw_contents(stub, client, images):
    """What tritonclient does not send (it sends raw contents): the protocol's typed `contents`."""
    message = pb.ModelInferRequest(model_name="vit", id="typed")
    tensor = message.inputs.add(name="PIXELS", datatype="FP32", shape=list(images.shape))
    tensor.contents.fp32_contents.extend((images.astype(np.float32) / 255.0).reshape(-1).tolist())
    typed = stub.ModelInfer(message, timeout=PATIENCE_S)
    assert typed.id == "typed" and [o.name for o in typed.outputs] == ["PROBABILITIES", "LABEL"]
    probabilities = np.frombuffer(typed.raw_output_contents[0], np.float32).reshape(len(images), 10)
    pixels = tgrpc.InferInput("PIXELS", list(images.shape), "FP32")
    pixels.set_data_from_numpy(images.astype(np.float32) / 255.0)
    np.testing.assert_allclose(probabilities, client.infer("vit", [pixels]).as_numpy("PROBABILITIES"), atol=1e-6)

    prompt = pb.ModelInferRequest(model_name="gpt")
    prompt.inputs.add(name="PROMPT", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"ROMEO:\n")
    for key, value in GREEDY.items():
        prompt.parameters[key].int64_param = value
    text = stub.ModelInfer(prompt, timeout=PATIENCE_S).raw_output_contents[0][4:].decode()
    assert text == client.infer("gpt", [text_input("PROMPT", ["ROMEO:\n"])], parameters=GREEDY).as_numpy(
        "TEXT")[0].decode()


def test_the_request_id_is_kept_logged_and_sent_back(stub, server):
    message = pb.ModelInferRequest(model_name="gpt")
    message.inputs.add(name="PROMPT", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"ROMEO:\n")
    message.parameters["max_new_tokens"].int64_param = 2
    _, call = stub.ModelInfer.with_call(message, metadata=(("x-request-id", "grpc-id-1"),), timeout=PATIENCE_S)
    assert dict(call.trailing_metadata())["x-request-id"] == "grpc-id-1"
    message.parameters["max_new_tokens"].int64_param = 10_000
    with pytest.raises(grpc.RpcError) as refused:
        stub.ModelInfer(message, metadata=(("x-request-id", "grpc-id-2"),), timeout=PATIENCE_S)
    assert dict(refused.value.trailing_metadata())["x-request-id"] == "grpc-id-2"
    _, untamed = stub.ModelInfer.with_call(_small(message), metadata=(
        ("x-request-id", "no spaces allowed"),), timeout=PATIENCE_S)
    made_up = dict(untamed.trailing_metadata())["x-request-id"]
    assert made_up != "no spaces allowed" and len(made_up) == 32
    poll(lambda: all(server.access_records(i) for i in ("grpc-id-1", "grpc-id-2", made_up)), timeout=PATIENCE_S,
         message="the access-log lines")  # they come through a reader thread
    records = {r["request_id"]: r for r in server.access_records() if r.get("method") == "GRPC"}
    assert records["grpc-id-1"]["status"] == 200 and records["grpc-id-2"]["status"] == 400
    assert records["grpc-id-1"]["path"] == "/inference.GRPCInferenceService/ModelInfer"
    assert records["grpc-id-1"]["model"] == "gpt" and records[made_up]["status"] == 200


def _small(message: pb.ModelInferRequest) -> pb.ModelInferRequest:
    small = pb.ModelInferRequest()
    small.CopyFrom(message)
    small.parameters["max_new_tokens"].int64_param = 2
    return small


@pytest.mark.parametrize("parameters", [{"num_beams": 4}, {"num_beams": 1}])
def test_translation_equals_rest(client, rest, parameters):
    result = client.infer("translation", [text_input("TEXT", GERMAN)], parameters=parameters)
    native = rest.post("/v1/translate", json={"text": GERMAN, **parameters}).json()["translations"]
    assert strings(result.as_numpy("TRANSLATION")) == [n[0]["text"] for n in native]
    np.testing.assert_allclose(result.as_numpy("SCORE"), [n[0]["score"] for n in native], atol=1e-5)


def test_gpt_equals_rest_and_async_infer_and_aio_agree(client, rest):
    prompts = ["ROMEO:\n", "KING:\n"]
    result = client.infer("gpt", [text_input("PROMPT", prompts)], parameters={**GREEDY, "stop": "\n\n"},
                          request_id="r-7")
    assert result.get_response().id == "r-7"
    texts = strings(result.as_numpy("TEXT"))
    for prompt, text in zip(prompts, texts):
        native = rest.post("/v1/generate", json={"prompt": prompt, **GREEDY, "stop": ["\n\n"]}).json()
        assert text == native["text"]
    done: queue.Queue = queue.Queue()
    client.async_infer("gpt", [text_input("PROMPT", prompts)], callback=lambda result, error: done.put((result, error)),
                       parameters={**GREEDY, "stop": "\n\n"})
    answer, error = done.get(timeout=STREAM_WAIT_S)
    assert error is None and strings(answer.as_numpy("TEXT")) == texts

    async def aio():
        async with tgrpc_aio.InferenceServerClient(grpc_url_of(client)) as c:
            assert await c.is_server_ready()
            r = await c.infer("gpt", [text_input("PROMPT", prompts)], parameters={**GREEDY, "stop": "\n\n"})
            return strings(r.as_numpy("TEXT"))

    assert asyncio.run(aio()) == texts


def grpc_url_of(client: tgrpc.InferenceServerClient) -> str:
    return client._channel._channel.target().decode()


# --- streaming --------------------------------------------------------------------------------------------------


def collect_stream(client, model: str, inputs, parameters: dict, empty_final: bool = False, count: int = 1):
    """Every response of `count` requests sent on one stream, by request id, until each says it is final."""
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for i in range(count):
            client.async_stream_infer(model, inputs, request_id=f"s{i}", parameters=parameters,
                                      enable_empty_final_response=empty_final)
        by_id: dict[str, list] = {f"s{i}": [] for i in range(count)}
        open_ids = set(by_id)
        while open_ids:
            result, error = responses.get(timeout=STREAM_WAIT_S)
            assert error is None, error
            response = result.get_response()
            by_id[response.id].append(result)
            if response.parameters["triton_final_response"].bool_param:
                open_ids.discard(response.id)
        return by_id
    finally:
        client.stop_stream()


def test_streamed_gpt_text_equals_rest_and_sse(client, rest):
    body = {"prompt": "ROMEO:\n", **GREEDY}
    by_id = collect_stream(client, "gpt", [text_input("PROMPT", [body["prompt"]])], GREEDY, count=2)
    rest_text = rest.post("/v1/generate", json=body).json()
    sse = rest.post("/v1/generate", json={**body, "stream": True})
    sse_text = "".join(event["token"] for event in parse_sse(sse.content))
    for results in by_id.values():
        assert len(results) > 1  # streamed, not one response
        finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
        assert finals == [False] * (len(results) - 1) + [True]
        streamed = "".join(strings(r.as_numpy("TEXT"))[0] for r in results)
        assert streamed == rest_text["text"] == sse_text
        assert [r.as_numpy("FINISH_REASON") is None for r in results[:-1]] == [True] * (len(results) - 1)
        assert strings(results[-1].as_numpy("FINISH_REASON")) == [rest_text["finish_reason"]]


def test_the_empty_final_response_comes_after_the_data_when_asked(client):
    (results,) = collect_stream(client, "gpt", [text_input("PROMPT", ["KING:\n"])], GREEDY,
                                empty_final=True).values()
    last = results[-1].get_response()
    assert last.parameters["triton_final_response"].bool_param and not last.outputs
    assert all(not r.get_response().parameters["triton_final_response"].bool_param for r in results[:-1])
    assert "".join(strings(r.as_numpy("TEXT"))[0] for r in results[:-1]) == client.infer(
        "gpt", [text_input("PROMPT", ["KING:\n"])], parameters=GREEDY).as_numpy("TEXT")[0].decode()


def test_streamed_translation_and_what_cannot_stream(client, rest, images):
    (greedy,) = collect_stream(client, "translation", [text_input("TEXT", GERMAN[:1])], {"num_beams": 1}).values()
    native = rest.post("/v1/translate", json={"text": GERMAN[0], "num_beams": 1}).json()["translations"][0][0]
    assert "".join(strings(r.as_numpy("TRANSLATION"))[0] for r in greedy) == native["text"]
    assert greedy[-1].as_numpy("SCORE")[0] == pytest.approx(native["score"], abs=1e-5)
    # beams, several texts and images: one response each, the whole result, final
    for texts, parameters in [(GERMAN[:1], {"num_beams": 4}), (GERMAN, {"num_beams": 1})]:
        (results,) = collect_stream(client, "translation", [text_input("TEXT", texts)], parameters).values()
        assert len(results) == 1
        native = rest.post("/v1/translate", json={"text": texts, **parameters}).json()["translations"]
        assert strings(results[0].as_numpy("TRANSLATION")) == [t[0]["text"] for t in native]
    encoded = tgrpc.InferInput("IMAGE", [1], "BYTES")
    encoded.set_data_from_numpy(np.array([png_bytes(images[0])], dtype=object))
    (vit,) = collect_stream(client, "vit", [encoded], {}).values()
    assert len(vit) == 1 and vit[0].as_numpy("PROBABILITIES").shape == (1, 10)


def test_aio_stream_infer(client):
    prompt = text_input("PROMPT", ["ROMEO:\n"])

    async def requests():
        yield {"model_name": "gpt", "inputs": [prompt], "request_id": "a0", "parameters": GREEDY}

    async def run():
        async with tgrpc_aio.InferenceServerClient(grpc_url_of(client)) as c:
            pieces = []
            async for result, error in c.stream_infer(requests()):
                assert error is None, error
                pieces.append(strings(result.as_numpy("TEXT"))[0])
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
            return "".join(pieces)

    assert asyncio.run(run()) == client.infer("gpt", [prompt], parameters=GREEDY).as_numpy("TEXT")[0].decode()


def test_an_error_in_a_stream_ends_that_request_only(client):
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        client.async_stream_infer("gpt", [text_input("PROMPT", ["x"])], request_id="bad",
                                  parameters={"max_new_tokens": 10_000})
        client.async_stream_infer("gpt", [text_input("PROMPT", ["ROMEO:\n"])], request_id="good",
                                  parameters={"max_new_tokens": 3})
        errors, finished = [], False
        while not finished or not errors:
            result, error = responses.get(timeout=STREAM_WAIT_S)
            if error is not None:
                errors.append(error)
            elif result.get_response().parameters["triton_final_response"].bool_param:
                finished = result.get_response().id == "good"
        assert "max_new_tokens" in errors[0].message()
    finally:
        client.stop_stream()


# --- errors, deadlines, cancellation ------------------------------------------------------------------------------


@pytest.mark.parametrize("model, inputs, parameters, code, named", [
    ("nope", [("PROMPT", ["x"])], {}, "StatusCode.NOT_FOUND", "nope"),
    ("gpt", [("WRONG", ["x"])], {}, "StatusCode.INVALID_ARGUMENT", "PROMPT"),
    ("gpt", [("PROMPT", ["x"])], {"max_new_tokens": 10_000}, "StatusCode.INVALID_ARGUMENT", "max_new_tokens"),
    ("gpt", [("PROMPT", ["x"])], {"temprature": 0.5}, "StatusCode.INVALID_ARGUMENT", "temprature"),
    ("gpt", [("PROMPT", ["x"])], {"prompt": "y"}, "StatusCode.INVALID_ARGUMENT", "PROMPT input"),
    ("translation", [("TEXT", ["x"])], {"num_beams": 99}, "StatusCode.INVALID_ARGUMENT", "num_beams"),
    ("vit", [("IMAGE", ["not an image"])], {}, "StatusCode.INVALID_ARGUMENT", "IMAGE[0]"),
])
def test_bad_requests_are_status_codes_naming_what_is_wrong(client, model, inputs, parameters, code, named):
    with pytest.raises(InferenceServerException) as error:
        client.infer(model, [text_input(name, values) for name, values in inputs], parameters=parameters)
    assert error.value.status() == code and named in error.value.message(), error.value


def test_a_bad_version_and_a_wrong_datatype_and_what_is_not_offered(server, client, stub):
    with pytest.raises(InferenceServerException) as version:
        client.infer("gpt", [text_input("PROMPT", ["x"])], model_version="01")
    assert version.value.status() == "StatusCode.INVALID_ARGUMENT" and "01" in version.value.message()
    wrong = tgrpc.InferInput("PROMPT", [1], "INT64")
    wrong.set_data_from_numpy(np.array([3], np.int64))
    with pytest.raises(InferenceServerException) as datatype:
        client.infer("gpt", [wrong])
    assert datatype.value.status() == "StatusCode.INVALID_ARGUMENT" and "BYTES" in datatype.value.message()
    with pytest.raises(grpc.RpcError) as shared:
        stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(), timeout=10,
                                      metadata=(("x-request-id", "grpc-unoffered"),))
    assert shared.value.code() == grpc.StatusCode.UNIMPLEMENTED and "shared memory" in shared.value.details()
    record = poll(lambda: next((r for r in server.access_records() if r.get("request_id") == "grpc-unoffered"),
                               None), timeout=PATIENCE_S, message="the access line of the unoffered call")
    assert record["status"] == 501  # not offered, not a fault of the service (500); logged after the reply


def test_the_grpc_deadline_is_the_requests_and_its_work_is_dropped(client, rest):
    before = scrape(rest)
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as late:
        client.infer("translation", [text_input("TEXT", HEAVY_TEXTS)], parameters=HEAVY, client_timeout=0.3)
    assert late.value.status() == "StatusCode.DEADLINE_EXCEEDED", late.value
    assert time.monotonic() - started < 0.3 + 2.0  # at the deadline, not when the work would have ended

    def settled():
        samples = scrape(rest)
        return samples if (metric(samples, "tserve_running_requests", model="translation") == 0
                           and metric(samples, "tserve_queue_depth", model="translation") == 0) else None

    poll(settled, timeout=PATIENCE_S, message="the timed-out translation's rows freed")
    # the `timeout` parameter (microseconds, tritonclient's `timeout=`) is a deadline too
    with pytest.raises(InferenceServerException) as parameter:
        client.infer("translation", [text_input("TEXT", HEAVY_TEXTS)], parameters=HEAVY, timeout=100_000)
    assert parameter.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    after = poll(settled, timeout=PATIENCE_S, message="the second translation's rows freed")
    assert metric(after, "tserve_request_failures_total", model="translation") > metric(
        before, "tserve_request_failures_total", model="translation")


def test_cancelling_a_stream_frees_the_requests_rows(serving, tiny_repository, monkeypatch):
    """The cancel lands by construction: the GPT's decoding steps are held at a gate (in-process, on the engine), so
    the request cannot finish before the server has seen its stream cancelled; then the step goes on and the
    batcher drops the request's rows."""
    from service.settings import Settings

    settings = Settings(repository=tiny_repository, models=["gpt"], grpc_port=free_port(), drain_delay_s=0)
    with serving(settings) as rest:
        engine = rest.app.state.registry.resolve("gpt", None, None).engine
        waiting, opened = threading.Event(), threading.Event()
        step = engine.step

        def held_step(*args, **kwargs):
            waiting.set()
            assert opened.wait(timeout=PATIENCE_S), "the test never opened the gate"
            return step(*args, **kwargs)

        monkeypatch.setattr(engine, "step", held_step)
        client = tgrpc.InferenceServerClient(f"127.0.0.1:{settings.grpc_port}")
        prompt = "ROMEO:\n"
        parameters = {"max_new_tokens": engine.context_length - len(prompt.encode()), "temperature": 0}
        before = scrape(rest)
        try:
            client.start_stream(callback=lambda result, error: None)
            client.async_stream_infer("gpt", [text_input("PROMPT", [prompt])], parameters=parameters)
            assert waiting.wait(timeout=PATIENCE_S), "the request never reached a decoding step"
            client.stop_stream(cancel_requests=True)  # its step is held: it cannot have finished

            def cancelled():
                return (metric(scrape(rest), "tserve_request_failures_total", model="gpt", reason="cancelled")
                        - metric(before, "tserve_request_failures_total", model="gpt", reason="cancelled"))

            poll(cancelled, timeout=PATIENCE_S, message="the stream's request counted as cancelled")
        finally:
            opened.set()
            client.close()

        def settled():
            samples = scrape(rest)
            return samples if metric(samples, "tserve_running_requests", model="gpt") == 0 else None

        after = poll(settled, timeout=PATIENCE_S, message="tserve_running_requests{model=gpt} == 0")
        assert cancelled() == 1
        generated = (metric(after, "tserve_generated_tokens_total", model="gpt")
                     - metric(before, "tserve_generated_tokens_total", model="gpt"))
        assert 1 <= generated < parameters["max_new_tokens"]


# --- servers of their own: API keys, overload, message sizes, drain -----------------------------------------------


def test_api_keys_are_bearer_metadata_and_health_stays_open(server_factory):
    with server_factory("grpc keys", grpc_port=free_port(), api_keys=json.dumps([API_KEY])) as process:
        client = tgrpc.InferenceServerClient(grpc_url(process))
        prompt = [text_input("PROMPT", ["ROMEO:\n"])]
        for headers, problem in [(None, "missing API key"), ({"authorization": "Bearer wrong-key-0123456789"},
                                                             "invalid API key"),
                                 ({"authorization": f"Basic {API_KEY}"}, "unsupported Authorization scheme")]:
            for call in (lambda: client.infer("gpt", prompt, headers=headers, parameters={"max_new_tokens": 2}),
                         lambda: client.is_server_ready(headers=headers),
                         lambda: client.get_model_metadata("gpt", headers=headers)):
                with pytest.raises(InferenceServerException) as refused:
                    call()
                assert refused.value.status() == "StatusCode.UNAUTHENTICATED", refused.value
                assert problem in refused.value.message() and API_KEY not in refused.value.message()
        good = {"authorization": f"Bearer {API_KEY}"}
        assert client.is_server_ready(headers=good)
        answer = client.infer("gpt", prompt, headers=good, parameters={"max_new_tokens": 2})
        assert answer.as_numpy("TEXT").shape == (1,)
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)), headers=good)
        client.async_stream_infer("gpt", prompt, parameters={"max_new_tokens": 2})
        result, error = results.get(timeout=STREAM_WAIT_S)
        assert error is None
        client.stop_stream()
        refused: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: refused.put((result, error)))
        try:
            client.async_stream_infer("gpt", prompt, parameters={"max_new_tokens": 2})
        except InferenceServerException:
            pass  # the stream was refused before this request went out: the callback says why
        result, error = refused.get(timeout=STREAM_WAIT_S)
        assert result is None and "UNAUTHENTICATED" in str(error.status()), error
        client.stop_stream()
        with grpc.insecure_channel(grpc_url(process)) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        client.close()


def test_model_repository_index_load_and_unload(server_factory, client):
    """Triton's model repository extension over gRPC, as tritonclient calls it: the index (with model control off
    too), unload and load (model control on), and PERMISSION_DENIED for a load with it off."""
    index = client.get_model_repository_index(as_json=True)["models"]
    assert {(m["name"], m["state"]) for m in index} >= {("gpt", "READY"), ("vit", "READY"), ("translation", "READY")}
    with pytest.raises(InferenceServerException) as off:
        client.load_model("vit")
    assert off.value.status() == "StatusCode.PERMISSION_DENIED", off.value
    with server_factory("grpc control", grpc_port=free_port(), model_control="true") as process:
        control = tgrpc.InferenceServerClient(grpc_url(process))
        control.unload_model("vit")
        poll(lambda: not control.is_model_ready("vit"), timeout=PATIENCE_S, message="vit unloaded")
        states = {m["name"]: m["state"] for m in control.get_model_repository_index(as_json=True)["models"]}
        assert states["vit"] == "UNAVAILABLE" and states["gpt"] == "READY"
        control.load_model("vit")
        assert control.is_model_ready("vit")
        with pytest.raises(InferenceServerException) as unknown:
            control.load_model("nope")
        assert unknown.value.status() == "StatusCode.NOT_FOUND", unknown.value
        with pytest.raises(InferenceServerException) as configured:
            control.load_model("vit", config='{"max_batch_size": 8}')
        assert configured.value.status() == "StatusCode.INVALID_ARGUMENT" and "config" in configured.value.message()
        control.close()


def test_overload_is_resource_exhausted_with_a_retry_hint(server_factory):
    knobs = {"max_queue_size": 1, "translation_max_batch_rows": 8, "max_prefill_requests": 1}
    with server_factory("grpc overload", grpc_port=free_port(), **knobs) as process:
        codes, hints = [], []
        lock = threading.Lock()

        def one(channel):
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            message = pb.ModelInferRequest(model_name="translation")
            message.inputs.add(name="TEXT", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
                GERMAN[0].encode())
            for key, value in HEAVY.items():
                message.parameters[key].int64_param = value
            try:
                stub.ModelInfer(message, timeout=120)
                outcome, hint = grpc.StatusCode.OK, None
            except grpc.RpcError as error:
                outcome, hint = error.code(), dict(error.trailing_metadata() or ()).get("retry-after")
            with lock:
                codes.append(outcome)
                hints.append(hint)

        with grpc.insecure_channel(grpc_url(process)) as channel:
            threads = [threading.Thread(target=one, args=(channel,)) for _ in range(12)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=180)
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
        assert grpc.StatusCode.OK in codes and grpc.StatusCode.RESOURCE_EXHAUSTED in codes, codes
        for code, hint in zip(codes, hints):
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                assert hint is not None and int(hint) >= 1


def test_a_message_over_the_body_limit_is_refused(server_factory):
    limit = 4096
    with server_factory("grpc limits", grpc_port=free_port(), max_body_bytes=limit) as process:
        client = tgrpc.InferenceServerClient(grpc_url(process))
        with pytest.raises(InferenceServerException) as refused:
            client.infer("gpt", [text_input("PROMPT", ["x" * (2 * limit)])])
        assert refused.value.status() == "StatusCode.RESOURCE_EXHAUSTED", refused.value
        assert client.infer("gpt", [text_input("PROMPT", ["ROMEO:\n"])], parameters={"max_new_tokens": 2})
        client.close()


def test_sigterm_lets_a_call_in_flight_finish(server_factory):
    process = server_factory("grpc drain", grpc_port=free_port(), models='["translation"]', drain_delay_s=1.0)
    try:
        process.start()
        client = tgrpc.InferenceServerClient(grpc_url(process))
        outcome: queue.Queue = queue.Queue()
        client.async_infer("translation", [text_input("TEXT", HEAVY_TEXTS)], parameters=HEAVY,
                           callback=lambda result, error: outcome.put((result, error)), client_timeout=120)
        with httpx.Client(base_url=process.url, timeout=10) as rest:
            poll(lambda: metric(scrape(rest), "tserve_running_requests", model="translation") > 0,
                 timeout=PATIENCE_S, interval=0.01, message="the translation in flight")
        process.send_signal(signal.SIGTERM)
        with grpc.insecure_channel(grpc_url(process)) as channel:  # draining: the gRPC probe says so at once
            health = health_pb2_grpc.HealthStub(channel)
            poll(lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                 == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=PATIENCE_S, interval=0.05,
                 message="grpc.health.v1 NOT_SERVING after SIGTERM")
        result, error = outcome.get(timeout=120)
        assert error is None, error
        assert len(result.as_numpy("TRANSLATION")) == len(HEAVY_TEXTS)
        assert process.wait(timeout=60) == 0
        client.close()
    finally:
        process.stop()
