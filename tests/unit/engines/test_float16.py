"""The float16 variants' graphs (`service.engines.float16`, `service.engines.weights` `fp16`, `fp16+gqa`), checked on
the CPU: every float constant becomes float16 (clamped into its range), the ops ONNX Runtime's converter blocks keep
float32 behind Casts, the graph's inputs and outputs keep their names and float32 type, and ONNX Runtime's CPU
provider runs the result (it casts most float16 ops back to float32: float16-rounded weights, float32 arithmetic),
within the float16 weight-rounding error of the float32 graph. The CUDA run is tests/gpu/test_fp16_variant.py's."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.engines import float16 as F
from service.engines.onnx_graph import ModelProto, load
from service.engines.weights import FLOAT16_VARIANTS, derive
from service.repository import ModelRepository
from tests.support.repository import add_in_place_gpt

K, N = 24, 16
ROWS = 3


def _graph(path):
    """x (float32) -> MatMul(w, stored float16 + Cast) -> Add(b) -> Where(mask, -3.4e38) -> logits, and the row
    candidates' LogSoftmax -> TopK after it (blocked: float32); mask from an int64 input Cast to bool."""
    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((K, N)).astype(np.float16), rng.standard_normal(N).astype(np.float32)
    nodes = [helper.make_node("Cast", ["w16"], ["w"], to=TensorProto.FLOAT, name="w_cast"),
             helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "b"], ["hb"], name="bias"),
             helper.make_node("Cast", ["keep"], ["keep_bool"], to=TensorProto.BOOL, name="keep_cast"),
             helper.make_node("Where", ["keep_bool", "hb", "lowest"], ["logits"], name="mask"),
             helper.make_node("LogSoftmax", ["logits"], ["log_probs"], axis=-1, name="log_softmax"),
             helper.make_node("TopK", ["log_probs", "k"], ["top", "top_ids"], axis=-1, name="top_k")]
    initializers = [numpy_helper.from_array(w, "w16"), numpy_helper.from_array(b, "b"),
                    numpy_helper.from_array(np.array(-3.4028235e38, np.float32), "lowest"),
                    numpy_helper.from_array(np.array([2], np.int64), "k")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", K]),
                     helper.make_tensor_value_info("keep", TensorProto.INT64, ["rows", N])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", N]),
         helper.make_tensor_value_info("top", TensorProto.FLOAT, ["rows", 2]),
         helper.make_tensor_value_info("top_ids", TensorProto.INT64, ["rows", 2])], initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _session(graph):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])


def _signature(model: ModelProto):
    return ([(i.name, i.type.tensor_type.elem_type) for i in model.graph.input],
            [(o.name, o.type.tensor_type.elem_type) for o in model.graph.output])


@pytest.mark.parametrize("values, expected", [
    ([1.0, -2.5, 0.0], [1.0, -2.5, 0.0]),
    ([-3.4028235e38, 1e6, -np.inf, np.inf], [-65504.0, 65504.0, -65504.0, 65504.0]),  # a mask's lowest: finite
    ([1e-12, -1e-12], [F.FLOAT16_TINY, -F.FLOAT16_TINY]),  # an epsilon stays nonzero
])
def test_constants_are_clamped_into_float16s_range(values, expected):
    np.testing.assert_allclose(F.float16_array(np.array(values, np.float32)).astype(np.float32),
                               np.array(expected, np.float16).astype(np.float32))


def test_the_graph_computes_in_float16_behind_float32_inputs_and_outputs(tmp_path):
    model = load(_graph(tmp_path / "g.onnx"))
    signature = _signature(model)
    assert F.to_float16(model) == 2  # b and the mask's lowest; w was float16 already, k is int64
    assert _signature(model) == signature  # the same names and types for the engines
    types = F.element_types(model)
    nodes = {n.name: n for n in model.graph.node}
    assert "w_cast" not in nodes and nodes["mm"].input[1] == "w16"  # float16 storage read directly: no Cast
    assert types["hb"] == types["logits__fp16"] == TensorProto.FLOAT16 and types["logits"] == TensorProto.FLOAT
    assert nodes["mask"].output[0] == "logits__fp16"  # the graph output is its float32 Cast
    assert nodes["log_softmax"].input[0] == "logits"  # blocked: it reads that float32 Cast, no second Cast
    assert types["log_probs"] == types["top"] == TensorProto.FLOAT
    assert {t.name: t.data_type for t in model.graph.initializer} == {
        "w16": TensorProto.FLOAT16, "b": TensorProto.FLOAT16, "lowest": TensorProto.FLOAT16, "k": TensorProto.INT64}
    lowest = next(t for t in model.graph.initializer if t.name == "lowest")
    assert np.frombuffer(lowest.raw_data, np.float16)[0] == -65504.0

    x = np.random.default_rng(1).standard_normal((ROWS, K)).astype(np.float32)
    keep = np.ones((ROWS, N), np.int64)
    keep[:, 0] = 0
    feeds = {"x": x, "keep": keep}
    reference = _session(str(tmp_path / "g.onnx")).run(None, feeds)
    logits, top, top_ids = _session(model.SerializeToString()).run(None, feeds)
    assert logits.dtype == np.float32 and logits[0, 0] == -65504.0  # masked: float16's lowest, not -inf
    # each output rounded once to float16 (x, b, the sum), within a few unit roundoffs of its magnitude
    scale = np.abs(reference[0][:, 1:]).max()
    np.testing.assert_allclose(logits[:, 1:], reference[0][:, 1:], atol=8 * F.UNIT_ROUNDOFF * scale)
    np.testing.assert_array_equal(top_ids, reference[2])


@pytest.fixture(scope="module")
def gpt(tiny_repository_copy, data_dir):
    """The tiny GPT's in-place conversion (fused attention, a step graph: what `+gqa` rewrites)."""
    return ModelRepository(add_in_place_gpt(tiny_repository_copy("float16", ("gpt",)), data_dir)).get("gpt", 2)


@pytest.mark.parametrize("variant", FLOAT16_VARIANTS)
def test_the_tiny_gpts_float16_graphs_keep_their_signature_and_run_on_the_cpu(gpt, variant):
    for file in ("decoder", "decoder_step"):
        path = gpt.path / gpt.config["files"][file]
        candidates = file == "decoder_step"
        derived = derive(path, variant, row_candidates=candidates, fuse=True)
        model, reference = ModelProto(), ModelProto()
        model.ParseFromString(derived)
        reference.ParseFromString(derive(path, "fp32", row_candidates=candidates, fuse=True) or path.read_bytes())
        assert _signature(model) == _signature(reference)
        floats = [t for t in model.graph.initializer if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16)]
        assert floats and all(t.data_type == TensorProto.FLOAT16 for t in floats)
        blocked = [n for n in model.graph.node if n.op_type in F.FLOAT32_OPS]
        types = F.element_types(model)
        assert all(types[name] != TensorProto.FLOAT16 for n in blocked for name in (*n.input, *n.output) if name)
        _session(derived)  # ONNX Runtime's CPU provider loads it


def test_the_tiny_gpts_float16_prompt_pass_is_within_the_weight_rounding_error(gpt):
    """On the CPU, ONNX Runtime computes the float16 graph in float32 on float16-rounded weights: the weights' part
    of the float16 error, held to the whole error's tolerance (`logits_tolerance`)."""
    path = gpt.path / gpt.config["files"]["decoder"]
    sessions = [_session(derive(path, variant) or str(path)) for variant in ("fp32", "fp16")]
    arch = gpt.config["architecture"]
    rows, length = 2, 12
    feeds = {"input_ids": np.random.default_rng(2).integers(0, arch["vocab_size"] - 1, (rows, length)),
             "position_ids": np.tile(np.arange(length), (rows, 1)), "attention_mask": np.ones((rows, length))}
    feeds = {name: value.astype(np.int64) for name, value in feeds.items()}
    for i in sessions[0].get_inputs()[len(feeds):]:
        feeds[i.name] = np.zeros((rows, arch["n_heads"], 0, arch["head_dim"]), np.float32)
    reference, half = (s.run(None, feeds)[0] for s in sessions)
    assert np.abs(half - reference).max() <= F.logits_tolerance(arch["n_layers"], np.abs(reference).max())
    assert (half.argmax(-1) == reference.argmax(-1)).mean() >= 0.9
