"""The Open Inference Protocol (KServe v2, as Triton serves it over REST): the inference request and response
shapes, and tensors in and out of them, in JSON or with Triton's binary tensor data extension.

A request body is JSON, or (extension) `Inference-Header-Content-Length: L` bytes of JSON followed by the raw data
of the inputs whose `parameters.binary_data_size` says so, in input order. A response is JSON, or JSON followed by
the raw data of the outputs asked for in binary (`outputs[].parameters.binary_data`, or `binary_data_output` for
all), each output's JSON saying its `binary_data_size`. Raw data is little-endian; a BYTES element is a 4-byte
little-endian length and its bytes. Triton's classification extension: an output asked for with
`parameters.classification: k` is the top k of its scores per row, as BYTES "score:index:label".
"""

from __future__ import annotations

import json
import struct
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.errors import BadInput, describe_validation

HEADER_LENGTH = "inference-header-content-length"
# datatype -> numpy dtype (little-endian); BYTES are Python bytes objects
DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
          "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
          "FP32": np.float32, "FP64": np.float64}
Datatype = Literal["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16",
                   "FP32", "FP64", "BYTES"]
# request parameters that belong to the protocol, not to the model
RESERVED_PARAMETERS = ("timeout", "binary_data_output", "priority", "sequence_id", "sequence_start", "sequence_end")
MAX_DIMENSION = 2**31


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RequestInput(_Message):
    name: str
    shape: list[int] = Field(..., max_length=8)
    datatype: Datatype
    parameters: dict[str, Any] = Field(default_factory=dict)
    data: list[Any] | None = None


class RequestOutput(_Message):
    name: str
    parameters: dict[str, Any] = Field(default_factory=dict)


class InferenceRequest(_Message):
    id: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    inputs: list[RequestInput] = Field(..., min_length=1)
    outputs: list[RequestOutput] | None = None


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


def parse_request(body: bytes, header_length: str | None) -> tuple[InferenceRequest, dict[str, np.ndarray], set[str]]:
    """The request, its input tensors by name (BYTES: object arrays of bytes), and the names of the inputs that came
    as JSON data (a BYTES element in JSON is text, so an image sent that way is base64 text)."""
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise BadInput(f"Inference-Header-Content-Length {header_length!r} does not fit a body of {len(body)} "
                           "bytes")
        split = int(header_length)
    else:
        split = len(body)
    try:
        request = InferenceRequest.model_validate(json.loads(body[:split]))
    except (ValueError, RecursionError) as error:  # invalid JSON, or not the protocol's shape
        raise BadInput(_describe(error)) from None
    raw, offset, tensors, in_json = body[split:], 0, {}, set()
    for tensor in request.inputs:
        if tensor.name in tensors:
            raise BadInput(f"input {tensor.name!r} given twice")
        size = tensor.parameters.get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(raw):
                raise BadInput(f"input {tensor.name!r}: binary_data_size {size!r} exceeds the binary data sent")
            tensors[tensor.name] = _from_bytes(tensor, raw[offset : offset + size])
            offset += size
        elif tensor.data is None:
            raise BadInput(f"input {tensor.name!r} has neither data nor binary_data_size")
        else:
            tensors[tensor.name] = _from_json(tensor)
            in_json.add(tensor.name)
    if offset != len(raw):
        raise BadInput(f"{len(raw) - offset} bytes of binary data belong to no input")
    return request, tensors, in_json


def _describe(error: Exception) -> str:
    if isinstance(error, ValidationError):
        return describe_validation(error.errors())
    return f"the inference request is not valid JSON ({type(error).__name__})"


def _elements(tensor: RequestInput) -> int:
    if any(d < 0 or d > MAX_DIMENSION for d in tensor.shape):
        raise BadInput(f"input {tensor.name!r}: shape {tensor.shape} has a negative or huge dimension")
    return int(np.prod(tensor.shape, dtype=np.int64))


def _from_bytes(tensor: RequestInput, raw: bytes) -> np.ndarray:
    count = _elements(tensor)
    if tensor.datatype == "BYTES":
        items, offset = [], 0
        while offset < len(raw):
            if offset + 4 > len(raw):
                raise BadInput(f"input {tensor.name!r}: BYTES data ends inside an element's length")
            (length,) = struct.unpack_from("<I", raw, offset)
            if offset + 4 + length > len(raw):
                raise BadInput(f"input {tensor.name!r}: a BYTES element is longer than the data sent")
            items.append(raw[offset + 4 : offset + 4 + length])
            offset += 4 + length
        if len(items) != count:
            raise BadInput(f"input {tensor.name!r}: {len(items)} BYTES elements for shape {tensor.shape}")
        return np.array(items, dtype=object).reshape(tensor.shape)
    dtype = np.dtype(DTYPES[tensor.datatype]).newbyteorder("<")
    if len(raw) != count * dtype.itemsize:
        raise BadInput(f"input {tensor.name!r}: {len(raw)} bytes of {tensor.datatype} for shape {tensor.shape}")
    return np.frombuffer(raw, dtype=dtype).reshape(tensor.shape)


def _from_json(tensor: RequestInput) -> np.ndarray:
    count = _elements(tensor)
    flat = np.array(tensor.data, dtype=object).reshape(-1) if tensor.data else np.array([], dtype=object)
    if len(flat) != count:
        raise BadInput(f"input {tensor.name!r}: {len(flat)} elements of data for shape {tensor.shape}")
    if tensor.datatype == "BYTES":
        if not all(isinstance(x, str) for x in flat):
            raise BadInput(f"input {tensor.name!r}: BYTES data in JSON must be strings")
        return np.array([x.encode("utf-8", "surrogatepass") for x in flat], dtype=object).reshape(tensor.shape)
    if tensor.datatype == "BOOL":
        valid = all(isinstance(x, bool) for x in flat)
    else:
        valid = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in flat)
    if not valid:
        raise BadInput(f"input {tensor.name!r}: data is not all {tensor.datatype}")
    try:
        return np.array(flat.tolist(), dtype=DTYPES[tensor.datatype]).reshape(tensor.shape)
    except (OverflowError, ValueError):
        raise BadInput(f"input {tensor.name!r}: a value does not fit {tensor.datatype}") from None


def encode_response(model: str, version: int, request: InferenceRequest,
                    outputs: list[tuple[str, str, np.ndarray]]) -> tuple[bytes, int | None]:
    """(body, JSON header length or None) of the response: `outputs` as (name, datatype, array), in binary where
    asked for."""
    binary_by_default = bool(request.parameters.get("binary_data_output", False))
    asked = {o.name: o.parameters for o in request.outputs or []}
    tensors, blobs = [], []
    for name, datatype, array in outputs:
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if asked.get(name, {}).get("binary_data", binary_by_default):
            blob = _to_bytes(datatype, array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = [x.decode("utf-8", "replace") for x in array.reshape(-1)] if datatype == "BYTES" \
                else array.reshape(-1).tolist()
        tensors.append(entry)
    header = {"model_name": model, "model_version": str(version), "outputs": tensors}
    if request.id is not None:
        header["id"] = request.id
    header_bytes = json.dumps(header).encode()
    if not blobs:
        return header_bytes, None
    return header_bytes + b"".join(blobs), len(header_bytes)


def _to_bytes(datatype: str, array: np.ndarray) -> bytes:
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(x)) + x for x in array.reshape(-1))
    return np.ascontiguousarray(array, dtype=np.dtype(DTYPES[datatype]).newbyteorder("<")).tobytes()


def classification(scores: np.ndarray, labels: list[str], k: int) -> np.ndarray:
    """Triton's classification extension: the top k of each row as BYTES "score:index:label", best first."""
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.array([[f"{row[i]:f}:{i}:{labels[i]}".encode() for i in indices]
                     for row, indices in zip(scores, top)], dtype=object)
