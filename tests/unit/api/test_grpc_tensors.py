"""gRPC messages <-> tensors (`service.api.oip.grpc.tensors`) without a server: typed contents of every datatype
and raw contents give the arrays REST's binary extension gives for the same data; values that do not fit their
datatype, counts that do not fit the shape, contents in the wrong field, raw and typed contents mixed, a raw entry
missing, and the protocol's parameters of the wrong type are 400s naming the input or parameter; a response
carries every output raw, in order, with Triton's final-response flag when asked, and no NaN. The parameters a
client sends (`service.api.oip.grpc.wire.to_parameter`) read back as the values they were.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from service.api.oip.grpc import tensors, wire
from service.api.oip.grpc.generated import grpc_service_pb2 as pb
from service.api.oip.protocol import tensor_bytes
from service.errors import BadInput, ModelOutputError


def request(*inputs, raw: list[bytes] | None = None, **parameters) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="m", id="req-1", raw_input_contents=raw or [])
    for name, datatype, shape, contents in inputs:
        tensor = message.inputs.add(name=name, datatype=datatype, shape=shape)
        if contents:
            getattr(tensor.contents, tensors.CONTENTS_FIELD[datatype]).extend(contents)
    for key, value in parameters.items():
        message.parameters[key].CopyFrom(wire.to_parameter(value))
    return message


@pytest.mark.parametrize("datatype, values", [
    ("BOOL", [True, False, True, True]), ("INT8", [-128, 0, 5, 127]), ("INT16", [-32768, 1, 2, 32767]),
    ("INT32", [-2**31, 0, 7, 2**31 - 1]), ("INT64", [-2**63, 0, 1, 2**63 - 1]), ("UINT8", [0, 1, 200, 255]),
    ("UINT16", [0, 1, 2, 65535]), ("UINT32", [0, 1, 2, 2**32 - 1]), ("UINT64", [0, 1, 2, 2**64 - 1]),
    ("FP32", [0.5, -1.25, 3.0, 1e-3]), ("FP64", [0.1, -2.5, 1e300, 0.0]),
])
def test_typed_contents_equal_the_same_data_sent_raw(datatype, values):
    typed, parsed = tensors.parse_request(request(("X", datatype, [2, 2], values)))
    typed_array = parsed["X"]
    expected = np.array(values, dtype=tensors.DTYPES[datatype]).reshape(2, 2)
    raw_array = tensors.parse_request(request(("X", datatype, [2, 2], None),
                                              raw=[tensor_bytes(datatype, expected)]))[1]["X"]
    assert typed_array.dtype == raw_array.dtype == expected.dtype
    np.testing.assert_array_equal(typed_array, expected)
    np.testing.assert_array_equal(raw_array, expected)
    assert typed.id == "req-1" and typed.inputs[0].name == "X"


def test_bytes_contents_and_raw_bytes_give_the_same_object_array():
    items = [b"ROMEO:", b"", "\u00fcber".encode()]
    typed = tensors.parse_request(request(("PROMPT", "BYTES", [3], items)))[1]["PROMPT"]
    raw_data = b"".join(struct.pack("<I", len(x)) + x for x in items)
    raw = tensors.parse_request(request(("PROMPT", "BYTES", [3], None), raw=[raw_data]))[1]["PROMPT"]
    assert typed.dtype == raw.dtype == object
    assert list(typed) == list(raw) == items


def test_an_fp16_input_comes_raw():
    halves = np.array([0.5, 1.5], np.float16)
    parsed = tensors.parse_request(request(("H", "FP16", [2], None), raw=[halves.tobytes()]))[1]["H"]
    np.testing.assert_array_equal(parsed, halves)
    with pytest.raises(BadInput, match=r"^input 'H': FP16 has no typed contents; send it in raw_input_contents$"):
        tensors.parse_request(request(("H", "FP16", [2], None)))


@pytest.mark.parametrize("datatype, value", [("INT8", 128), ("INT8", -129), ("UINT8", 256),
                                             ("INT16", 2**15), ("UINT16", 2**16)])
def test_a_typed_value_that_does_not_fit_its_datatype_is_a_400(datatype, value):
    with pytest.raises(BadInput, match=rf"^input 'X': a value does not fit {datatype}$"):
        tensors.parse_request(request(("X", datatype, [1], [value])))


def test_a_nan_in_fp32_contents_is_carried_not_refused_here():
    """The model's checks refuse pixels outside [0, 1] (a NaN among them); the mapping keeps the value."""
    parsed = tensors.parse_request(request(("X", "FP32", [2], [float("nan"), 1.0])))[1]["X"]
    assert np.isnan(parsed[0]) and parsed[1] == 1.0


@pytest.mark.parametrize("message, error", [
    (request(("X", "FP32", [3], [1.0, 2.0])), r"^input 'X': 2 elements of contents\.fp32_contents for shape \[3\]$"),
    (request(("X", "FP32", [2], [1.0, 2.0]), raw=[b"", b""]),
     r"^raw_input_contents has 2 entries for 1 inputs: give one per input"),
    (request(("X", "FP32", [2], None), ("Y", "FP32", [1], None), raw=[np.zeros(2, np.float32).tobytes()]),
     r"^raw_input_contents has 1 entries for 2 inputs"),
    (request(("X", "FP32", [2], [1.0, 2.0]), raw=[np.zeros(2, np.float32).tobytes()]),
     r"^input 'X': typed contents beside raw_input_contents; give one of them$"),
    (request(("X", "FP32", [2], None), raw=[np.zeros(3, np.float32).tobytes()]),
     r"^input 'X': 12 bytes of FP32 for shape \[2\]$"),
    (request(("X", "FP32", [-1], None), raw=[b""]), r"^input 'X': shape \[-1\] has a negative dimension$"),
    (request(("X", "FP32", [1], [1.0]), ("X", "FP32", [1], [2.0])), r"^input 'X' given twice$"),
    (request(("X", "NOPE", [1], None), raw=[b"\0"]), r"datatype"),
    (request(("X", "FP32", [1], [1.0]), timeout=True), r"^parameters\.timeout \(microseconds\) must be an integer"),
    (request(("X", "FP32", [1], [1.0]), timeout=0), r"^parameters\.timeout \(microseconds\) must be an integer >= 1"),
    (request(("X", "FP32", [1], [1.0]), priority=True), r"^parameters\.priority must be a non-negative integer"),
    (request(("X", "FP32", [1], [1.0]), triton_enable_empty_final_response=1),
     r"^parameters\.triton_enable_empty_final_response must be true or false, got 1$"),
])
def test_malformed_requests_are_400s_naming_what_is_wrong(message, error):
    with pytest.raises(BadInput, match=error):
        tensors.parse_request(message)


def test_contents_in_another_datatypes_field_are_a_400():
    message = request(("X", "FP32", [1], None))
    message.inputs[0].contents.int_contents.append(3)
    with pytest.raises(BadInput, match=r"^input 'X': FP32 data goes in contents\.fp32_contents, not in "
                                       r"\['int_contents'\]$"):
        tensors.parse_request(message)


@pytest.mark.parametrize("value, parameter", [
    (True, pb.InferParameter(bool_param=True)), (7, pb.InferParameter(int64_param=7)),
    (0.25, pb.InferParameter(double_param=0.25)), ("s", pb.InferParameter(string_param="s")),
])
def test_parameters_round_trip_with_their_json_types(value, parameter):
    assert wire.to_parameter(value) == parameter
    read = tensors.parameter_value(parameter)
    assert read == value and type(read) is type(value)
    assert tensors.parameter_value(pb.InferParameter(uint64_param=2**64 - 1)) == 2**64 - 1
    with pytest.raises(BadInput, match="^a parameter has no value$"):
        tensors.parameter_value(pb.InferParameter())


def test_request_parameters_and_requested_outputs_are_read():
    message = request(("X", "FP32", [1], [1.0]), temperature=0.0, max_new_tokens=5, stop="\n")
    message.outputs.add(name="PROBABILITIES").parameters["classification"].int64_param = 3
    parsed, _ = tensors.parse_request(message)
    assert parsed.parameters == {"temperature": 0.0, "max_new_tokens": 5, "stop": "\n"}
    assert [(o.name, o.parameters) for o in parsed.outputs] == [("PROBABILITIES", {"classification": 3})]
    assert tensors.parse_request(request(("X", "FP32", [1], [1.0])))[0].outputs is None


def test_the_response_carries_every_output_raw_in_order_with_the_final_flag():
    parsed, _ = tensors.parse_request(request(("X", "FP32", [1], [1.0])))
    probabilities = np.array([[0.25, 0.75]], np.float32)
    labels = np.array([b"Coat"], dtype=object)
    response = tensors.infer_response("vit", 3, parsed, [("PROBABILITIES", "FP32", probabilities),
                                                         ("LABEL", "BYTES", labels)])
    assert (response.model_name, response.model_version, response.id) == ("vit", "3", "req-1")
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [
        ("PROBABILITIES", "FP32", [1, 2]), ("LABEL", "BYTES", [1])]
    assert response.raw_output_contents[0] == probabilities.tobytes()
    assert response.raw_output_contents[1] == struct.pack("<I", 4) + b"Coat"
    assert tensors.FINAL_RESPONSE not in response.parameters
    final = tensors.infer_response("vit", 3, parsed, [("LABEL", "BYTES", labels)], final=True)
    assert final.parameters[tensors.FINAL_RESPONSE].bool_param is True
    assert tensors.infer_response("vit", 3, parsed, [], final=False).parameters[
        tensors.FINAL_RESPONSE].HasField("bool_param")
    empty = tensors.empty_final_response("gpt", 1, parsed)
    assert not empty.outputs and not empty.raw_output_contents and empty.id == "req-1"
    assert empty.parameters[tensors.FINAL_RESPONSE].bool_param is True


def test_an_output_holding_a_nan_is_a_model_output_error():
    parsed, _ = tensors.parse_request(request(("X", "FP32", [1], [1.0])))
    with pytest.raises(ModelOutputError, match="^output 'SCORE' holds a NaN or an infinity$"):
        tensors.infer_response("translation", 1, parsed, [("SCORE", "FP32", np.array([np.inf], np.float32))])
