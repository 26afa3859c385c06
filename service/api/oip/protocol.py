"""The Open Inference Protocol (KServe v2, as Triton serves it over REST): the inference request and response
shapes, and tensors in and out of them, in JSON or with Triton's binary tensor data extension
(`Inference-Header-Content-Length` bytes of JSON, then the raw data of the binary inputs or outputs), and
Triton's classification extension (`parameters.classification: k`: the top k per row, BYTES "score:index:label").

Invariant: everything a request says is checked before any work, 400 naming what is wrong (valid Unicode, the
header length, shapes against the data actually sent, the protocol's parameters of their types). Body fields
other than the KServe v2 REST schema's and the KServe SDK's (`model_name`, `model_version`) are refused, as are the
parameters this server does not implement (sequences, shared memory) unless they carry their default. `priority`
is Triton's: 0 the model's default level, 1 the most urgent (`triton_priority`).
A response never holds a NaN or an infinity (`ModelOutputError` instead).

Design notes (the wire format and every check): docs/architecture.md, service/api/oip/protocol.py.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from service.api.fields import ValidUnicode, ascii_digits
from service.api.oip.binary import BYTES_LENGTH, BYTES_LENGTH_SIZE, pack_bytes
from service.decoding import top_k_indices
from service.errors import BadInput, ModelOutputError, describe_validation, json_error_reason

HEADER_LENGTH = "inference-header-content-length"
# datatype -> numpy dtype (little-endian); BYTES are Python bytes objects
DTYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
          "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
          "FP32": np.float32, "FP64": np.float64}
Datatype = Literal["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16",
                   "FP32", "FP64", "BYTES"]
# Request parameters the protocol defines that this server does not implement -> the values that ask for nothing
# (accepted, and then nothing is to be done), and why any other value is refused.
UNSUPPORTED_PARAMETERS = {
    "sequence_id": ((0, ""), "sequences are not supported: no sequence batcher keeps state between requests"),
    "sequence_start": ((False,), "sequences are not supported: no sequence batcher keeps state between requests"),
    "sequence_end": ((False,), "sequences are not supported: no sequence batcher keeps state between requests"),
}
# Triton's decoupled-response switch (gRPC's ModelStreamInfer: an empty last response; nothing to do elsewhere)
EMPTY_FINAL_RESPONSE = "triton_enable_empty_final_response"
# request parameters that belong to the protocol, not to the model
# Triton's request priority: 0 = the model's default level, k >= 1 = level k - 1 (1 the most urgent)
PRIORITY = "priority"
RESERVED_PARAMETERS = ("timeout", "binary_data_output", EMPTY_FINAL_RESPONSE, PRIORITY, *UNSUPPORTED_PARAMETERS)
# Triton's shared-memory extension, as input or output parameters: not implemented (tensors travel in the body).
SHARED_MEMORY_PARAMETERS = ("shared_memory_region", "shared_memory_byte_size", "shared_memory_offset")
MAX_DIMENSIONS = 8  # dimensions an input shape may have: room above the most any model here takes (4)
# inputs / outputs a request may name: room above the most any model here has (2), so that a body of half a million
# tensor objects is refused by its count before it is validated
MAX_TENSORS = 16


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("parameters", mode="before", check_fields=False)
    @classmethod
    def _null_is_empty(cls, value):
        """`"parameters": null` is no parameters (KServe's schema makes every `parameters` optional and nullable)."""
        return {} if value is None else value


class RequestInput(_Message):
    name: str
    shape: list[int] = Field(..., max_length=MAX_DIMENSIONS)
    datatype: Datatype
    parameters: dict[str, Any] = Field(default_factory=dict)
    data: list[Any] | None = None


class RequestOutput(_Message):
    name: str
    parameters: dict[str, Any] = Field(default_factory=dict)


class InferenceRequest(_Message, ValidUnicode):
    id: str | None = None
    # what the KServe SDK puts in the body beside the URL's model (checked against it: `check_target`)
    model_name: str | None = None
    model_version: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)
    inputs: list[RequestInput] = Field(..., min_length=1, max_length=MAX_TENSORS)
    outputs: list[RequestOutput] | None = Field(None, max_length=MAX_TENSORS)

    def check_target(self, name: str, version: int) -> None:
        """400 when the body names another model or version than the one the URL resolved to."""
        if self.model_name is not None and self.model_name != name:
            raise BadInput(f"model_name {self.model_name[:80]!r} in the body is not the URL's model {name!r}")
        if self.model_version is not None and self.model_version != str(version):
            raise BadInput(f"model_version {self.model_version[:40]!r} in the body is not the version the URL "
                           f"resolved to ({version})")


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
        # ASCII digits, no more of them than the body's length has (int() of 5,000 digits raises, of "²" too)
        digits = header_length.lstrip("0") or "0"
        if not ascii_digits(header_length) or len(digits) > len(str(len(body))) or int(digits) > len(body):
            raise BadInput(f"Inference-Header-Content-Length {header_length[:40]!r} is not a length in ASCII digits "
                           f"that fits a body of {len(body)} bytes")
        split = int(digits)
    else:
        split = len(body)
    try:
        request = InferenceRequest.model_validate(json.loads(body[:split]))
    except (ValueError, RecursionError) as error:  # invalid JSON, or not the protocol's shape
        raise BadInput(_describe(error)) from None
    check_parameters(request)
    raw, offset, tensors, in_json = body[split:], 0, {}, set()
    for tensor in request.inputs:
        if tensor.name in tensors:
            raise BadInput(f"input {tensor.name!r} given twice")
        size = tensor.parameters.get("binary_data_size")
        if size is not None:
            integer_parameter(size, f"input {tensor.name!r}: binary_data_size", 0)
            if offset + size > len(raw):
                raise BadInput(f"input {tensor.name!r}: binary_data_size {size!r} exceeds the binary data sent")
            tensors[tensor.name] = tensor_from_bytes(tensor, raw[offset : offset + size], len(body))
            offset += size
        elif tensor.data is None:
            raise BadInput(f"input {tensor.name!r} has neither data nor binary_data_size")
        else:
            tensors[tensor.name] = _from_json(tensor, len(body))
            in_json.add(tensor.name)
    if offset != len(raw):
        raise BadInput(f"{len(raw) - offset} bytes of binary data belong to no input")
    return request, tensors, in_json


def _describe(error: Exception) -> str:
    if isinstance(error, ValidationError):
        return describe_validation(error.errors())
    return f"the inference request is not valid JSON ({json_error_reason(error)})"


def integer_parameter(value, name: str, minimum: int) -> int:
    """A protocol parameter that must be an integer of at least `minimum` (JSON's true is not 1, nor 2.0 two)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BadInput(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def boolean_parameter(value, name: str) -> bool:
    """A protocol parameter that must be true or false (1 and "yes" are not)."""
    if not isinstance(value, bool):
        raise BadInput(f"{name} must be true or false, got {value!r}")
    return value


def triton_priority(request: InferenceRequest) -> int | None:
    """The queue level (`service.scheduling.priority`, 0 the most urgent) that Triton's `priority` parameter asks
    for: None for 0 or none (the model's default), k - 1 for k >= 1; 400 for anything but a non-negative integer."""
    value = request.parameters.get(PRIORITY, 0)
    if type(value) is not int or value < 0:
        raise BadInput(f"parameters.{PRIORITY} must be a non-negative integer (Triton's: 0 = the model's default "
                       f"level, 1 = the most urgent), got {repr(value)[:40]}", param=f"parameters.{PRIORITY}")
    return value - 1 if value else None


def check_parameters(request: InferenceRequest) -> None:
    """The protocol's own parameters, of their types, before any work is done for the request."""
    refused = []
    for key, (defaults, why) in UNSUPPORTED_PARAMETERS.items():
        value = request.parameters.get(key, defaults[0])
        if not any(type(value) is type(default) and value == default for default in defaults):
            accepted = " or ".join(map(repr, defaults))
            refused.append(f"parameters.{key} {repr(value)[:40]}: {why} (only {accepted} is accepted)")
    if refused:
        raise BadInput("; ".join(refused))
    triton_priority(request)
    tensors = [("input", t) for t in request.inputs] + [("output", t) for t in request.outputs or []]
    for what, tensor in tensors:
        if shared := sorted(set(tensor.parameters) & set(SHARED_MEMORY_PARAMETERS)):
            raise BadInput(f"{what} {tensor.name!r}: parameter(s) {shared}: shared memory is not supported, the "
                           "tensors travel in the body")
    if "timeout" in request.parameters:
        integer_parameter(request.parameters["timeout"], "parameters.timeout (microseconds)", 1)
    for flag in ("binary_data_output", EMPTY_FINAL_RESPONSE):
        if flag in request.parameters:
            boolean_parameter(request.parameters[flag], f"parameters.{flag}")
    for output in request.outputs or []:
        if "binary_data" in output.parameters:
            boolean_parameter(output.parameters["binary_data"], f"output {output.name!r}: binary_data")
        if "classification" in output.parameters:
            integer_parameter(output.parameters["classification"], f"output {output.name!r}: classification", 1)


def elements(tensor: RequestInput, body_bytes: int) -> int:
    """The element count of the tensor's shape. Every element takes at least a byte of the body, so a shape of more
    elements than the body has bytes is refused before numpy sees it (its int64 product would wrap); zero
    dimensions count as one in that bound, so that an empty tensor's shape is one numpy can represent too."""
    if any(d < 0 for d in tensor.shape):
        raise BadInput(f"input {tensor.name!r}: shape {tensor.shape} has a negative dimension")
    if math.prod(max(d, 1) for d in tensor.shape) > max(body_bytes, 1):
        raise BadInput(f"input {tensor.name!r}: shape {tensor.shape} has more elements than a body of {body_bytes} "
                       "bytes can carry")
    return math.prod(tensor.shape)


def tensor_from_bytes(tensor: RequestInput, raw: bytes, body_bytes: int) -> np.ndarray:
    count = elements(tensor, body_bytes)
    if tensor.datatype == "BYTES":
        items, offset = [], 0
        while offset < len(raw):
            start = offset + BYTES_LENGTH_SIZE
            if start > len(raw):
                raise BadInput(f"input {tensor.name!r}: BYTES data ends inside an element's length")
            (length,) = struct.unpack_from(BYTES_LENGTH, raw, offset)
            if start + length > len(raw):
                raise BadInput(f"input {tensor.name!r}: a BYTES element is longer than the data sent")
            items.append(raw[start : start + length])
            offset = start + length
        if len(items) != count:
            raise BadInput(f"input {tensor.name!r}: {len(items)} BYTES elements for shape {tensor.shape}")
        return np.array(items, dtype=object).reshape(tensor.shape)
    dtype = np.dtype(DTYPES[tensor.datatype]).newbyteorder("<")
    if len(raw) != count * dtype.itemsize:
        raise BadInput(f"input {tensor.name!r}: {len(raw)} bytes of {tensor.datatype} for shape {tensor.shape}")
    return np.frombuffer(raw, dtype=dtype).reshape(tensor.shape)


def _from_json(tensor: RequestInput, body_bytes: int) -> np.ndarray:
    count = elements(tensor, body_bytes)
    flat = np.array(tensor.data, dtype=object).reshape(-1) if tensor.data else np.array([], dtype=object)
    if len(flat) != count:
        raise BadInput(f"input {tensor.name!r}: {len(flat)} elements of data for shape {tensor.shape}")
    if tensor.datatype == "BYTES":
        if not all(isinstance(x, str) for x in flat):
            raise BadInput(f"input {tensor.name!r}: BYTES data in JSON must be strings")
        return np.array([x.encode("utf-8") for x in flat], dtype=object).reshape(tensor.shape)  # valid Unicode
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
    asked for (the parameters' types were checked by `parse_request`). An output holding a NaN or an infinity is a
    `ModelOutputError`: JSON has no such numbers, and a score that is one is no answer."""
    check_finite(outputs)
    binary_by_default = request.parameters.get("binary_data_output", False)
    asked = {o.name: o.parameters for o in request.outputs or []}
    tensors, blobs = [], []
    for name, datatype, array in outputs:
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if asked.get(name, {}).get("binary_data", binary_by_default):
            blob = tensor_bytes(datatype, array)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = [x.decode("utf-8", "replace") for x in array.reshape(-1)] if datatype == "BYTES" \
                else array.reshape(-1).tolist()
        tensors.append(entry)
    header = {"model_name": model, "model_version": str(version), "outputs": tensors}
    if request.id is not None:
        header["id"] = request.id
    header_bytes = json.dumps(header, allow_nan=False).encode()
    if not blobs:
        return header_bytes, None
    return header_bytes + b"".join(blobs), len(header_bytes)


def check_finite(outputs: list[tuple[str, str, np.ndarray]]) -> None:
    """`ModelOutputError` for an output that holds a NaN or an infinity: no response may carry one."""
    for name, datatype, array in outputs:
        if datatype != "BYTES" and not np.isfinite(array).all():
            raise ModelOutputError(f"output {name!r} holds a NaN or an infinity")


def tensor_bytes(datatype: str, array: np.ndarray) -> bytes:
    """A tensor's raw data: little-endian; a BYTES element is its 4-byte length and its bytes."""
    if datatype == "BYTES":
        return pack_bytes(array.reshape(-1))
    return np.ascontiguousarray(array, dtype=np.dtype(DTYPES[datatype]).newbyteorder("<")).tobytes()


def classification(scores: np.ndarray, labels: list[str], k: int) -> np.ndarray:
    """Triton's classification extension: the top k of each row as BYTES "score:index:label", best first."""
    top = top_k_indices(scores, k)
    return np.array([[f"{row[i]:f}:{i}:{labels[i]}".encode() for i in indices]
                     for row, indices in zip(scores, top)], dtype=object)


def validated_options(model: type[BaseModel], data: dict, what: str):
    """An inference request's model options (its `parameters`, with the input they apply to) as the native API's
    request `model` checks them: the same limits and messages, a 400 here naming `what`. The result's `to_params`
    maps them to the serving parameters, as it does a native request."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise BadInput(f"{what}: {describe_validation(error.errors())}") from None
