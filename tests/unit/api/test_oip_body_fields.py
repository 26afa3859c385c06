"""The Open Inference Protocol's request body as the SDKs send it (`service.api.oip.protocol.parse_request`): the
KServe SDK's `model_name` / `model_version` and the schema's nullable `parameters` are accepted, `id` is echoed,
the protocol's unimplemented parameters are refused unless they carry their default, and shared memory is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from service.api.oip.protocol import encode_response, parse_request
from service.errors import BadInput

PROMPT = {"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": ["x"]}


def parse(**fields):
    return parse_request(json.dumps({"inputs": [PROMPT], **fields}).encode(), None)[0]


def test_the_kserve_sdk_body_is_accepted_and_its_id_echoed():
    request = parse(id="a1", model_name="gpt", model_version="3", parameters=None, outputs=None)
    assert (request.model_name, request.model_version, request.parameters) == ("gpt", "3", {})
    request.check_target("gpt", 3)
    body, _ = encode_response("gpt", 3, request, [("TEXT", "BYTES", np.array([b"y"], dtype=object))])
    assert json.loads(body)["id"] == "a1"
    nulls = parse(inputs=[{**PROMPT, "parameters": None}], outputs=[{"name": "TEXT", "parameters": None}])
    assert nulls.inputs[0].parameters == {} and nulls.outputs[0].parameters == {}


@pytest.mark.parametrize(("fields", "named"), [({"model_name": "vit"}, "model_name"),
                                               ({"model_version": "2"}, "model_version"),
                                               ({"model_version": "03"}, "model_version")])
def test_a_body_that_names_another_model_or_version_is_refused(fields, named):
    with pytest.raises(BadInput, match=named):
        parse(**fields).check_target("gpt", 3)


def test_an_unknown_field_is_refused_by_name():
    with pytest.raises(BadInput, match="sequence"):
        parse(sequence=1)


@pytest.mark.parametrize("defaults", [{"priority": 0}, {"sequence_id": 0}, {"sequence_id": ""},
                                      {"sequence_start": False, "sequence_end": False}])
def test_unimplemented_parameters_at_their_default_ask_for_nothing(defaults):
    assert parse(parameters=defaults).parameters == defaults


@pytest.mark.parametrize(("parameters", "named"), [
    ({"priority": -1}, "priority"), ({"priority": False}, "priority"), ({"priority": "1"}, "priority"),
    ({"sequence_id": 7}, "sequence_id"),
    ({"sequence_id": "s"}, "sequence_id"), ({"sequence_start": True}, "sequence_start"),
    ({"sequence_start": 0}, "sequence_start"), ({"sequence_end": True}, "sequence_end")])
def test_unimplemented_parameters_are_refused_by_name(parameters, named):
    with pytest.raises(BadInput, match=named):
        parse(parameters=parameters)


@pytest.mark.parametrize(("priority", "level"), [(0, None), (1, 0), (3, 2), (7, 6)])
def test_tritons_priority_is_a_queue_level_1_the_most_urgent_0_the_default(priority, level):
    from service.api.oip.protocol import triton_priority

    assert triton_priority(parse(parameters={"priority": priority})) == level


def test_every_refused_parameter_is_named_at_once():
    with pytest.raises(BadInput) as refused:
        parse(parameters={"sequence_id": 4, "sequence_end": True})
    assert "sequence_id" in str(refused.value) and "sequence_end" in str(refused.value)


@pytest.mark.parametrize("fields", [{"inputs": [{**PROMPT, "parameters": {"shared_memory_region": "in0"}}]},
                                    {"outputs": [{"name": "TEXT", "parameters": {"shared_memory_byte_size": 8}}]}])
def test_shared_memory_is_refused(fields):
    with pytest.raises(BadInput, match="shared_memory"):
        parse(**fields)
