"""Content codings (`service.http.compression`) on a real server: gzip and deflate request bodies on every API
(native JSON and multipart, OpenAI, Open Inference Protocol), decoded within the body limit (a gzip bomb is a 413,
decoded without the memory), corrupt streams 400, other codings 415, each in its API's error shape; responses
compressed when asked and large, never a small one nor an event stream; and the real `tritonclient.http` with
`request_compression_algorithm` and `response_compression_algorithm`, gzip and deflate, on the ViT and the GPT.
"""

from __future__ import annotations

import ast
import asyncio
import gzip
import json
import re
import tracemalloc
import zlib

import httpx
import numpy as np
import pytest
import tritonclient.http as triton

from service.client.sse import parse_sse
from service.http.compression import DecodedBody, response_coding
from service.http.errors import ClientBodyError
from tests.support.images import png_bytes
from tests.support.triton_inputs import text_input

pytestmark = pytest.mark.slow

MAX_BODY_BYTES = 1_000_000
BOMB_BYTES = 30 * MAX_BODY_BYTES  # zeros: about 30 kB once gzipped, under the limit as it travels
GENERATE = {"prompt": "ROMEO:\n", "max_new_tokens": 8, "temperature": 0}
COMPLETION = {"model": "gpt", "prompt": "ROMEO:\n", "max_tokens": 8, "temperature": 0}
OIP_GPT = {"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ["ROMEO:\n"]}],
           "parameters": {"max_new_tokens": 8, "temperature": 0}}
# (API, path, JSON body): a route of each API that reads a body
ROUTES = [("native", "/v1/generate", GENERATE), ("openai", "/v1/completions", COMPLETION),
          ("oip", "/v2/models/gpt/infer", OIP_GPT)]
ROUTE_IDS = [api for api, _, _ in ROUTES]
CODERS = {"gzip": gzip.compress, "x-gzip": gzip.compress, "deflate": zlib.compress, "identity": lambda b: b,
          "GZip": gzip.compress}


@pytest.fixture(scope="module")
def server(server_factory):
    with server_factory("compression server", max_body_bytes=MAX_BODY_BYTES, max_new_tokens=60) as process:
        yield process


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def post(http: httpx.Client, path: str, body: bytes, encoding: str | None,
         content_type: str = "application/json") -> httpx.Response:
    headers = {"content-type": content_type, **({"content-encoding": encoding} if encoding else {})}
    return http.post(path, content=body, headers=headers)


def error_of(api: str, response: httpx.Response) -> tuple[str | None, str]:
    """(error type, message) of an error body in `api`'s shape; the protocol's shape has no type."""
    error = response.json()["error"]
    if api == "oip":
        assert isinstance(error, str), response.text
        return None, error
    if api == "openai":
        assert set(error) == {"message", "type", "param", "code"}, response.text
        return error["code"], error["message"]
    assert set(error) == {"type", "message"}, response.text
    return error["type"], error["message"]


# --- request bodies ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding", list(CODERS))
@pytest.mark.parametrize(("api", "path", "payload"), ROUTES, ids=ROUTE_IDS)
def test_a_coded_body_is_served_as_the_plain_one(http, api, path, payload, encoding):
    plain = http.post(path, json=payload)
    assert plain.status_code == 200, plain.text
    coded = post(http, path, CODERS[encoding](json.dumps(payload).encode()), encoding)
    assert coded.status_code == 200, coded.text
    assert coded.json().keys() == plain.json().keys()
    text = {"native": lambda r: r["text"], "openai": lambda r: r["choices"][0]["text"],
            "oip": lambda r: r["outputs"][0]["data"]}[api]
    assert text(coded.json()) == text(plain.json())


def test_gzip_members_are_one_body_and_a_multipart_upload_decodes(http, data_dir):
    body = json.dumps(GENERATE).encode()
    members = gzip.compress(body[:10]) + gzip.compress(body[10:])  # RFC 1952: a gzip file may hold several
    assert post(http, "/v1/generate", members, "gzip").json()["text"] == http.post("/v1/generate",
                                                                                 json=GENERATE).json()["text"]
    from models.data import load_fashion_mnist

    images = load_fashion_mnist(data_dir, "test")[0][:2]
    files = [("files", (f"{i}.png", png_bytes(image), "image/png")) for i, image in enumerate(images)]
    form = http.build_request("POST", "/v1/classify", files=files, data={"top_k": "3"})
    plain = http.send(form).json()["predictions"]
    coded = post(http, "/v1/classify", gzip.compress(form.read()), "gzip", form.headers["content-type"])
    assert coded.status_code == 200, coded.text
    assert coded.json()["predictions"] == plain


@pytest.mark.parametrize(("api", "path", "payload"), ROUTES, ids=ROUTE_IDS)
def test_a_gzip_bomb_is_413_in_the_apis_shape(http, server, api, path, payload):
    bomb = gzip.compress(b"\0" * BOMB_BYTES)
    assert len(bomb) < MAX_BODY_BYTES // 10
    response = post(http, path, bomb, "gzip")
    assert response.status_code == 413, response.text
    kind, message = error_of(api, response)
    assert kind in (None, "payload_too_large")
    assert f"exceeds {MAX_BODY_BYTES} bytes once decoded from gzip" in message
    assert response.headers["connection"] == "close"
    within = post(http, path, gzip.compress(json.dumps(payload).encode() + b" " * (MAX_BODY_BYTES // 2)), "gzip")
    assert within.status_code == 200, within.text  # padded to half the limit once decoded: served


@pytest.mark.parametrize(("encoding", "body", "reason"), [
    ("gzip", b'{"prompt": "not gzip"}', "incorrect header check"),
    ("gzip", gzip.compress(json.dumps(GENERATE).encode())[:-12], "truncated"),
    ("deflate", gzip.compress(json.dumps(GENERATE).encode()), "incorrect header check"),
    ("deflate", zlib.compress(json.dumps(GENERATE).encode()) + b"more", "data after the end of the deflate stream"),
], ids=["not-gzip", "truncated", "gzip-sent-as-deflate", "deflate-trailing-data"])
@pytest.mark.parametrize(("api", "path", "payload"), ROUTES, ids=ROUTE_IDS)
def test_a_corrupt_stream_is_400_naming_its_coding(http, api, path, payload, encoding, body, reason):
    response = post(http, path, body, encoding)
    assert response.status_code == 400, response.text
    kind, message = error_of(api, response)
    assert kind in (None, "invalid_content_encoding")
    assert f"not a valid {encoding} stream" in message and reason in message


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, br", "gzip, gzip", "deflate, gzip"])
@pytest.mark.parametrize(("api", "path", "payload"), ROUTES, ids=ROUTE_IDS)
def test_another_coding_is_415_naming_the_supported_ones(http, api, path, payload, encoding):
    response = post(http, path, gzip.compress(json.dumps(payload).encode()), encoding)
    assert response.status_code == 415, response.text
    kind, message = error_of(api, response)
    assert kind in (None, "unsupported_content_encoding")
    assert "send the body as one of gzip, deflate, or identity" in message
    assert response.headers["accept-encoding"] == "gzip, deflate"  # RFC 7694


def test_a_coding_on_a_route_that_reads_no_body_is_ignored(http):
    response = http.get("/v1/models", headers={"content-encoding": "br"})
    assert response.status_code == 200 and response.json()["data"]


def test_a_bomb_is_decoded_without_the_memory():
    """In-process: 256 MiB of zeros gzipped, fed as a client sends it (64 KiB messages), against a 1 MB limit: the
    413 comes after at most the limit (and one step) was decoded; inflating it whole would take 256 MiB."""
    size, chunk = 256 << 20, 64 << 10
    compressor = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(16 << 20)
    bomb = b"".join(compressor.compress(zeros) for _ in range(size // len(zeros))) + compressor.flush()
    messages = [{"type": "http.request", "body": bomb[i:i + chunk], "more_body": i + chunk < len(bomb)}
                for i in range(0, len(bomb), chunk)]

    async def receive():
        return messages.pop(0)

    async def read_all(body: DecodedBody) -> int:
        total, more = 0, True
        while more:
            message = await body()
            total, more = total + len(message["body"]), message["more_body"]
        return total

    del zeros
    tracemalloc.start()
    try:
        with pytest.raises(ClientBodyError) as error:
            asyncio.run(read_all(DecodedBody(receive, "gzip", MAX_BODY_BYTES)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert error.value.status_code == 413
    assert peak < 8 * MAX_BODY_BYTES, f"decoding the bomb peaked at {peak} bytes"


def test_a_body_decodes_in_steps_and_a_disconnect_passes_through():
    data = bytes(range(256)) * 1000  # 256 kB
    messages = [{"type": "http.request", "body": zlib.compress(data), "more_body": False},
                {"type": "http.disconnect"}]

    async def receive():
        return messages.pop(0)

    async def read():
        body = DecodedBody(receive, "deflate", len(data), step_bytes=100_000)
        parts = [await body() for _ in range(3)]
        return parts, await body()

    parts, after = asyncio.run(read())
    assert [len(p["body"]) for p in parts] == [100_000, 100_000, 56_000]
    assert [p["more_body"] for p in parts] == [True, True, False]
    assert b"".join(p["body"] for p in parts) == data and after == {"type": "http.disconnect"}


# --- responses -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("accept", "chosen"), [
    ("gzip", "gzip"), ("deflate", "deflate"), ("GZIP", "gzip"), ("gzip, deflate, br", "gzip"),
    ("deflate, gzip", "gzip"), ("gzip;q=0.5, deflate", "deflate"), ("gzip;q=0, deflate;q=0.1", "deflate"),
    ("*", "gzip"), ("*;q=0, deflate", "deflate"), ("br", None), ("", None), ("identity", None),
    ("gzip;q=0", None), ("gzip;q=2", None), ("gzip;q=abc", None), ("gzip ; q=0.001", "gzip"),
])
def test_the_response_coding_is_the_one_weighted_highest(accept, chosen):
    assert response_coding(accept) == chosen


def raw(http: httpx.Client, method: str, path: str, accept: str, **kwargs) -> tuple[httpx.Response, bytes]:
    """A response and its body as it travelled (httpx would decode it)."""
    with http.stream(method, path, headers={"accept-encoding": accept}, **kwargs) as response:
        return response, b"".join(response.iter_raw())


@pytest.mark.parametrize(("accept", "decode"), [("gzip", gzip.decompress), ("deflate", zlib.decompress)])
def test_a_large_response_is_compressed_when_asked(http, accept, decode):
    plain, plain_body = raw(http, "GET", "/openapi.json", "identity")
    assert "content-encoding" not in plain.headers and len(plain_body) > 10_000
    response, body = raw(http, "GET", "/openapi.json", accept)
    assert response.headers["content-encoding"] == accept and response.headers["vary"] == "Accept-Encoding"
    assert int(response.headers["content-length"]) == len(body) < len(plain_body) // 3
    assert decode(body) == plain_body


def test_a_small_response_is_sent_as_it_is(http):
    response, body = raw(http, "POST", "/v1/generate", "gzip, deflate", json={**GENERATE, "max_new_tokens": 2})
    assert response.status_code == 200 and len(body) < 1000
    assert "content-encoding" not in response.headers and json.loads(body)["text"]


def test_an_event_stream_is_never_compressed(http):
    with http.stream("POST", "/v1/completions", headers={"accept-encoding": "gzip, deflate"},
                     json={**COMPLETION, "max_tokens": 40, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert "content-encoding" not in response.headers
        chunks = list(response.iter_raw())
    assert chunks[0].startswith(b"data: {")  # events as they were written, not a coded stream
    assert b"[DONE]" not in chunks[0]  # the first event came while the stream went on: nothing held it back
    assert len(parse_sse(b"".join(chunks))) > 1


# --- tritonclient --------------------------------------------------------------------------------------------------

ALGORITHMS = ["gzip", "deflate"]
RESPONSE_HEADER = re.compile(r"<HTTPSocketPoolResponse status=200 headers=(\{.*?\})>")


@pytest.fixture(scope="module")
def triton_client(server):
    c = triton.InferenceServerClient(url=server.url.removeprefix("http://"), verbose=True)  # shows the headers
    yield c
    c.close()


def response_encodings(printed: str) -> list[str | None]:
    """The Content-Encoding of each response the verbose client printed."""
    found = []
    for match in RESPONSE_HEADER.finditer(printed):
        headers = {k.lower(): v for k, v in ast.literal_eval(match.group(1)).items()}  # a dict's repr
        found.append(headers.get("content-encoding"))
    return found


@pytest.mark.parametrize("response_algorithm", ALGORITHMS)
@pytest.mark.parametrize("request_algorithm", ALGORITHMS)
def test_tritonclient_compression_on_the_vit(triton_client, data_dir, capsys, request_algorithm,
                                             response_algorithm):
    from models.data import load_fashion_mnist

    images = load_fashion_mnist(data_dir, "test")[0][:16]
    tensor = triton.InferInput("IMAGE", [len(images)], "BYTES")
    tensor.set_data_from_numpy(np.array([png_bytes(image) for image in images], dtype=object))
    outputs = [triton.InferRequestedOutput("PROBABILITIES", binary_data=False)]  # JSON: over the minimum size
    plain = triton_client.infer("vit", [tensor], outputs=outputs).as_numpy("PROBABILITIES")
    capsys.readouterr()
    coded = triton_client.infer("vit", [tensor], outputs=outputs, request_compression_algorithm=request_algorithm,
                                response_compression_algorithm=response_algorithm)
    printed = capsys.readouterr().out
    assert f"'Content-Encoding': '{request_algorithm}'" in printed  # what the client sent
    assert response_encodings(printed) == [response_algorithm]
    np.testing.assert_array_equal(coded.as_numpy("PROBABILITIES"), plain)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_tritonclient_compression_on_the_gpt(triton_client, capsys, algorithm):
    prompts = [f"{name}:\n" for name in ("ROMEO", "KING", "JULIET", "QUEEN")] * 6  # over the minimum size
    parameters = {"max_new_tokens": 50, "temperature": 0}
    plain = triton_client.infer("gpt", [text_input("PROMPT", prompts)], parameters=parameters).as_numpy("TEXT")
    capsys.readouterr()
    coded = triton_client.infer("gpt", [text_input("PROMPT", prompts)], parameters=parameters,
                                request_compression_algorithm=algorithm, response_compression_algorithm=algorithm)
    printed = capsys.readouterr().out
    assert response_encodings(printed) == [algorithm]  # binary tensors: the JSON header's length is the decoded one
    assert list(coded.as_numpy("TEXT")) == list(plain)
