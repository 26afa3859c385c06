"""The weights variants derived when a graph loads (`service.engines.weights`), against ONNX Runtime itself: the
int8 blocks derived from float weights are the ones its `MatMulNBitsQuantizer` writes (`export.quantize`), and the
float32 graph derived from MatMulNBits computes what MatMulNBits computes with float activations (accuracy_level
0), for 8- and 4-bit weights, symmetric or with zero points, with and without a bias. And the vendored ONNX schema
(`service.engines.onnx_graph`) reads and writes graphs byte for byte."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from export.compress import store_weights_as_fp16
from export.quantize import _quantizer_class, quantize_int8
from service.engines import weights as W
from service.engines.onnx_graph import ModelProto, from_array, load, protos, to_array
from service.engines.onnx_graph import TensorProto as OurTensorProto

K, N, N2 = 80, 48, 40  # K is no multiple of the block (32): the last block is padded
ROWS = 5


def _float_graph(path, seed=0):
    """x (rows, K) -> MatMul(W1) -> Relu -> MatMul(W2) -> y; and z = x @ x^T, a MatMul with no constant weight."""
    rng = np.random.default_rng(seed)
    w1, w2 = rng.standard_normal((K, N)).astype(np.float32), rng.standard_normal((N, N2)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
             helper.make_node("Transpose", ["x"], ["xt"]), helper.make_node("MatMul", ["x", "xt"], ["z"], name="xx")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", N2]),
                               helper.make_tensor_value_info("z", TensorProto.FLOAT, ["rows", "rows"])],
                              [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _run(graph, x):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(graph if isinstance(graph, bytes) else str(graph), options,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def _x(seed=1):
    return np.random.default_rng(seed).standard_normal((ROWS, K)).astype(np.float32)


def _initializers(model):
    return {t.name: to_array(t) for t in model.graph.initializer}


def test_int8_blocks_are_those_onnx_runtimes_quantiser_writes(tmp_path):
    exported = quantize_int8(_float_graph(tmp_path / "exported.onnx"))  # export.quantize: the exporter's path
    assert exported
    model = load(_float_graph(tmp_path / "float.onnx"))
    assert W.to_int8(model) == 2  # the two constant weights; x @ x^T stays a MatMul
    ours, theirs = _initializers(model), _initializers(load(tmp_path / "exported.onnx"))
    for weight in ("w1", "w2"):
        np.testing.assert_array_equal(ours[f"{weight}_Q8"], theirs[f"{weight}_Q8"])
        np.testing.assert_array_equal(ours[f"{weight}_scales"].ravel(), theirs[f"{weight}_scales"].ravel())
    ops = [(n.op_type, n.domain) for n in model.graph.node]
    assert ops.count(("MatMulNBits", "com.microsoft")) == 2 and ops.count(("MatMul", "")) == 1
    assert "w1" not in ours and "w2" not in ours  # the float weights are gone
    node = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    assert {a.name: a.i for a in node.attribute} == {"K": K, "N": N, "bits": 8, "block_size": 32, "accuracy_level": 4}
    y, z = _run(model.SerializeToString(), _x())
    y_ref, z_ref = _run(tmp_path / "exported.onnx", _x())
    np.testing.assert_array_equal(z, z_ref)
    np.testing.assert_allclose(y, y_ref, atol=1e-4 * np.abs(y_ref).max())


def test_float16_storage_is_quantised_from_its_float16_values_and_its_casts_removed(tmp_path):
    path = _float_graph(tmp_path / "half.onnx")
    store_weights_as_fp16(path, min_elements=1)
    model = load(path)
    halves = {t.name: to_array(t) for t in model.graph.initializer}
    assert W.to_int8(model) == 2
    assert not any(n.op_type == "Cast" for n in model.graph.node)
    assert not any(t.data_type == TensorProto.FLOAT16 for t in model.graph.initializer)
    packed, scales = W.quantized_weight(halves["w1__fp16"].astype(np.float32))
    np.testing.assert_array_equal(_initializers(model)["w1_Q8"], packed)
    np.testing.assert_array_equal(_initializers(model)["w1_scales"], scales)


@pytest.mark.parametrize("bits, symmetric", [(8, True), (8, False), (4, True), (4, False)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_from_matmulnbits_computes_what_matmulnbits_computes_with_float_activations(tmp_path, bits, symmetric,
                                                                                           bias):
    source = onnx.load(str(_float_graph(tmp_path / "float.onnx")))
    quantizer = _quantizer_class()(source, bits=bits, block_size=32, is_symmetric=symmetric, accuracy_level=0)
    quantizer.process()
    quantized = quantizer.model.model
    if bias:  # MatMulNBits' 6th input: added to the product
        node = next(n for n in quantized.graph.node if n.op_type == "MatMulNBits")
        node.input.extend([""] * (5 - len(node.input)) + ["b1"])
        quantized.graph.initializer.append(numpy_helper.from_array(np.linspace(-1, 1, N).astype(np.float32), "b1"))
    reference = quantized.SerializeToString()
    model = ModelProto()
    model.ParseFromString(reference)
    assert W.to_fp32(model) == 2
    assert W.graph_weights(model) == W.FP32
    assert not any(t.data_type == TensorProto.UINT8 for t in model.graph.initializer)  # the blocks are gone
    (y, z), (y_ref, z_ref) = _run(model.SerializeToString(), _x()), _run(reference, _x())
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5 * np.abs(y_ref).max())
    np.testing.assert_array_equal(z, z_ref)


def test_derive_gives_the_other_variant_keeps_it_and_none_for_the_stored_one(tmp_path):
    path = _float_graph(tmp_path / "float.onnx")
    assert W.derive(path, W.FP32) is None
    derived = W.derive(path, W.INT8)
    assert W.derive(path, W.INT8) is derived  # kept while the file is unchanged
    assert W.graph_weights(load(tmp_path / "float.onnx")) == W.FP32
    _float_graph(path, seed=2)  # the file changes: derived again
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert W.derive(path, W.INT8) != derived
    with pytest.raises(ValueError, match="one of"):
        W.derive(path, "bf16")
    assert W.graph_weights(ModelProto.FromString(W.derive(path, W.FP16))) == W.FP32  # float16 MatMul (test_float16)


def test_a_graph_with_no_constant_weight_has_no_int8_variant(tmp_path):
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])])
    onnx.save(helper.make_model(graph), str(tmp_path / "g.onnx"))
    with pytest.raises(ValueError, match="no MatMul with a constant"):
        W.derive(tmp_path / "g.onnx", W.INT8)


def test_the_vendored_schema_reads_and_writes_graphs_byte_for_byte(tmp_path):
    path = _float_graph(tmp_path / "g.onnx")
    quantize_int8(path)
    assert load(path).SerializeToString() == path.read_bytes()
    assert not protos.stale(), "run `make proto` and commit service/engines/onnx_graph/onnx_graph_pb2.py"


@pytest.mark.parametrize("array", [np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(4, dtype=np.int64),
                                   np.array([0.5, -2], np.float16), np.array([[255, 0]], np.uint8)])
def test_tensors_round_trip_and_read_as_onnx_reads_them(array):
    assert np.array_equal(to_array(from_array(array, "t")), array)
    assert to_array(from_array(array, "t")).dtype == array.dtype
    typed = helper.make_tensor("t", helper.np_dtype_to_tensor_dtype(array.dtype), array.shape,
                               array.ravel().tolist())  # values in the typed fields, not raw_data
    ours = OurTensorProto()
    ours.ParseFromString(typed.SerializeToString())
    assert np.array_equal(to_array(ours), numpy_helper.to_array(typed))
