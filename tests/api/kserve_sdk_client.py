"""Inference with the real KServe Python SDK (`kserve` 0.21), as its documentation shows it: `InferInput` with data
(a list, or `set_data_from_numpy`: binary), `InferRequest(model_name=..., infer_inputs=[...])`, and
`InferenceRESTClient(RESTConfig(protocol="v2")).infer(base_url, request, model_name=...)`, or for a `grpc://HOST:PORT`
address `InferenceGRPCClient(url="HOST:PORT").infer(request)` (outputs read with `as_numpy`).

It runs in its own venv (`make kserve-venv`, requirements/kserve.in says why), not in the test's, so it imports
nothing of the project: `python kserve_sdk_client.py BASE_URL|grpc://HOST:PORT CASES.json` reads the cases (model,
inputs, parameters, requested outputs, id) and prints, as one JSON line, each case's response (outputs by name:
shape, datatype, data; id; model_name) or its error (status, message). tests/support/kserve.py runs it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys

import grpc
import httpx
import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest, RESTConfig
from kserve.protocol.infer_type import InferOutput, RequestedOutput

NUMPY = {"FP32": np.float32, "BYTES": np.object_}
GRPC_SCHEME = "grpc://"
TIMEOUT_S = 120


def _input(spec: dict) -> InferInput:
    """An input as the SDK's docs build one: data in the constructor (JSON), or from numpy (binary)."""
    if not spec.get("binary"):
        return InferInput(name=spec["name"], shape=spec["shape"], datatype=spec["datatype"], data=spec["data"])
    tensor = InferInput(name=spec["name"], shape=spec["shape"], datatype=spec["datatype"])
    if spec["datatype"] == "BYTES":  # base64 in the case file (an image file is not text)
        array = np.array([base64.b64decode(x) for x in spec["data"]], dtype=np.object_).reshape(spec["shape"])
    else:
        array = np.array(spec["data"], dtype=NUMPY[spec["datatype"]]).reshape(spec["shape"])
    tensor.set_data_from_numpy(array)  # binary_data=True, the SDK's default
    return tensor


def _grpc_data(output: InferOutput) -> list:
    """A gRPC output's elements, flat as REST's JSON `data` (raw contents decoded by the SDK's `as_numpy`)."""
    values = output.as_numpy().flatten().tolist()
    return [v.decode() if isinstance(v, bytes) else v for v in values]


async def _run(base_url: str, cases: list[dict]) -> list[dict]:
    grpc_address = base_url.removeprefix(GRPC_SCHEME) if base_url.startswith(GRPC_SCHEME) else None
    if grpc_address:
        client = InferenceGRPCClient(url=grpc_address, timeout=TIMEOUT_S)
    else:
        client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=TIMEOUT_S))
    answers = []
    for case in cases:
        outputs = [RequestedOutput(o["name"], {"binary_data": o.get("binary", False)}) for o in case.get("outputs", [])]
        request = InferRequest(model_name=case["model"], infer_inputs=[_input(i) for i in case["inputs"]],
                               request_id=case.get("id"), parameters=case.get("parameters"),
                               request_outputs=outputs or None)
        try:
            if grpc_address:
                response = await client.infer(request)
            else:
                response = await client.infer(base_url, request, model_name=case.get("url_model", case["model"]))
        except httpx.HTTPStatusError as error:
            answers.append({"status": error.response.status_code, "error": error.response.json()["error"]})
            continue
        except grpc.RpcError as error:
            answers.append({"status": error.code().name, "error": error.details()})
            continue
        answers.append({"id": response.id, "model_name": response.model_name,
                        "outputs": {o.name: {"shape": list(o.shape), "datatype": o.datatype,
                                             "data": _grpc_data(o) if grpc_address else o.data}
                                    for o in response.outputs}})
    return answers


def main() -> None:
    base_url, cases_file = sys.argv[1], sys.argv[2]
    with open(cases_file) as file:
        cases = json.load(file)
    print(json.dumps(asyncio.run(_run(base_url, cases))))


if __name__ == "__main__":
    main()
