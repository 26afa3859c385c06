"""gRPC messages <-> the Open Inference Protocol's parsed request and output tensors (`service.api.oip.protocol`),
so that gRPC inference runs the same checks and core (`service.api.oip.inference`) as REST.

A `ModelInferRequest`'s inputs come as typed `contents` (the field of their datatype: `fp32_contents` for FP32,
`int_contents` for INT8/16/32, `bytes_contents` for BYTES, ...; FP16 has none, so it must come raw) or as
`raw_input_contents`, one entry per input in input order (tritonclient's default), laid out as REST's binary
extension lays them (little-endian; a BYTES element is a 4-byte length and its bytes), never both. Parameters are
`InferParameter`s (bool, int64, string, double or uint64), read as the JSON values REST would carry, so the same
type checks apply (`timeout` an integer, `binary_data` a bool, ...). Outputs go back as `raw_output_contents`, as
Triton's gRPC server answers; `binary_data` and `binary_data_output` (REST's choice of encoding) change nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import ValidationError

from service.api.oip.grpc.generated import grpc_service_pb2 as pb
from service.api.oip.grpc.wire import FINAL_RESPONSE
from service.api.oip.protocol import (
    DTYPES,
    EMPTY_FINAL_RESPONSE,
    InferenceRequest,
    RequestInput,
    check_finite,
    check_parameters,
    elements,
    tensor_bytes,
    tensor_from_bytes,
)
from service.errors import BadInput, describe_validation

# a datatype -> the InferTensorContents field its typed contents travel in (FP16 has none: raw only)
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
                  "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
                  "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
                  "FP64": "fp64_contents", "BYTES": "bytes_contents"}
# the numpy type that holds every value of a contents field, before it is narrowed to the input's datatype
FIELD_DTYPES = {"bool_contents": np.bool_, "int_contents": np.int64, "int64_contents": np.int64,
                "uint_contents": np.uint64, "uint64_contents": np.uint64, "fp32_contents": np.float64,
                "fp64_contents": np.float64}


def parameter_value(parameter: pb.InferParameter) -> Any:
    """An InferParameter as the JSON value REST would carry (a bool, an int, a str or a float)."""
    kind = parameter.WhichOneof("parameter_choice")
    if kind is None:
        raise BadInput("a parameter has no value")
    return getattr(parameter, kind)


def parameters_of(parameters) -> dict[str, Any]:
    return {key: parameter_value(value) for key, value in parameters.items()}


def parse_request(message: pb.ModelInferRequest) -> tuple[InferenceRequest, dict[str, np.ndarray]]:
    """The request (as REST's parser gives it; the model and version are the message's target, not checked against
    another) and its input tensors by name (BYTES: object arrays of bytes). 400 naming what is wrong."""
    inputs = message.inputs
    raw = list(message.raw_input_contents)
    if raw and len(raw) != len(inputs):
        raise BadInput(f"raw_input_contents has {len(raw)} entries for {len(inputs)} inputs: give one per input, in "
                       "input order, or none and typed contents")
    fields = {
        "id": message.id or None,
        "parameters": parameters_of(message.parameters),
        "inputs": [{"name": t.name, "shape": list(t.shape), "datatype": t.datatype,
                    "parameters": parameters_of(t.parameters), "data": []} for t in inputs],
        "outputs": [{"name": o.name, "parameters": parameters_of(o.parameters)} for o in message.outputs] or None,
    }
    try:
        request = InferenceRequest.model_validate(fields)
    except ValidationError as error:
        raise BadInput(describe_validation(error.errors())) from None
    check_parameters(request)
    size = message.ByteSize()
    tensors: dict[str, np.ndarray] = {}
    for i, (tensor, given) in enumerate(zip(request.inputs, inputs)):
        if tensor.name in tensors:
            raise BadInput(f"input {tensor.name!r} given twice")
        if raw:
            if given.HasField("contents"):
                raise BadInput(f"input {tensor.name!r}: typed contents beside raw_input_contents; give one of them")
            tensors[tensor.name] = tensor_from_bytes(tensor, raw[i], size)
        else:
            tensors[tensor.name] = _from_contents(tensor, given.contents, size)
    return request, tensors


def _from_contents(tensor: RequestInput, contents: pb.InferTensorContents, size: int) -> np.ndarray:
    count = elements(tensor, size)
    field = CONTENTS_FIELD.get(tensor.datatype)
    if field is None:
        raise BadInput(f"input {tensor.name!r}: {tensor.datatype} has no typed contents; send it in "
                       "raw_input_contents")
    others = [f.name for f, _ in contents.ListFields() if f.name != field]
    if others:
        raise BadInput(f"input {tensor.name!r}: {tensor.datatype} data goes in contents.{field}, not in {others}")
    values = getattr(contents, field)
    if len(values) != count:
        raise BadInput(f"input {tensor.name!r}: {len(values)} elements of contents.{field} for shape {tensor.shape}")
    if tensor.datatype == "BYTES":
        return np.array(list(values), dtype=object).reshape(tensor.shape)
    wide = np.array(values, dtype=FIELD_DTYPES[field])
    narrow = wide.astype(DTYPES[tensor.datatype])
    if not np.array_equal(narrow, wide, equal_nan=wide.dtype.kind == "f"):
        raise BadInput(f"input {tensor.name!r}: a value does not fit {tensor.datatype}")
    return narrow.reshape(tensor.shape)


def infer_response(model: str, version: int, request: InferenceRequest,
                   outputs: list[tuple[str, str, np.ndarray]], final: bool | None = None) -> pb.ModelInferResponse:
    """The response message: each output's metadata and its data in `raw_output_contents`, in the same order;
    `final` (a stream's responses): Triton's `triton_final_response` parameter. A NaN or an infinity in an output
    is a `ModelOutputError`, as on REST."""
    check_finite(outputs)
    response = pb.ModelInferResponse(model_name=model, model_version=str(version), id=request.id or "")
    for name, datatype, array in outputs:
        response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        response.raw_output_contents.append(tensor_bytes(datatype, array))
    if final is not None:
        response.parameters[FINAL_RESPONSE].bool_param = final
    return response


def empty_final_response(model: str, version: int, request: InferenceRequest) -> pb.ModelInferResponse:
    """The empty last response of a stream request that asked for one (EMPTY_FINAL_RESPONSE)."""
    response = pb.ModelInferResponse(model_name=model, model_version=str(version), id=request.id or "")
    response.parameters[FINAL_RESPONSE].bool_param = True
    return response
