"""The `int8rows` weights (`service.engines.integer_gemm`): ONNX Runtime's integer GEMM over activations quantised row
by row gives exactly the integers and floats the numpy reference below computes (so every row depends on itself
alone, on any CPU: 7-bit weights cannot saturate the u8 x s8 int16 pairs), whatever the batch; all-zero rows stay
zero; each activation is quantised once however many MatMuls read it; and the released models derived in it stay
near their float32 outputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.engines import weights as W
from service.engines.integer_gemm import (ACTIVATION_LIMIT, ACTIVATION_ZERO, INT8_ROWS, MATMUL_INTEGER_TO_FLOAT, TINY,
                                          WEIGHT_LIMIT, has_integer_gemm, quantized_columns, to_int8_rows)
from service.engines.onnx_graph import ModelProto
from service.engines.vit import ViTEngine
from service.engines.gpt import GPTEngine
from service.engines.runtime import RuntimeOptions
from service.repository import ModelRepository
from tests.support import ROOT

K, N, ROWS = 96, 40, 9
RELEASE_REPOSITORY = ROOT / "model_repository"


def _graph(opset: int = 17, seed: int = 0) -> tuple[ModelProto, dict[str, np.ndarray]]:
    """x (rows, 1, K) -> a = x @ Wa, b = x @ Wb (one input, two MatMuls), c = relu(a) @ Wc: three MatMuls, two inputs."""
    rng = np.random.default_rng(seed)
    weights = {"wa": rng.standard_normal((K, N)), "wb": rng.standard_normal((K, N)) * 3,
               "wc": rng.standard_normal((N, N))}
    weights = {name: w.astype(np.float32) for name, w in weights.items()}
    weights["wb"][:, 5] = 0  # an all-zero column
    nodes = [helper.make_node("MatMul", ["x", "wa"], ["a"], name="a"),
             helper.make_node("MatMul", ["x", "wb"], ["b"], name="b"),
             helper.make_node("Relu", ["a"], ["relu"], name="relu"),
             helper.make_node("MatMul", ["relu", "wc"], ["c"], name="c")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 1, K])],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["rows", 1, N]) for o in "abc"],
                              [numpy_helper.from_array(w, name) for name, w in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ModelProto.FromString(model.SerializeToString()), weights


def _run(model: ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["a", "b", "c"], {"x": x})


def _reference(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """What the rewritten MatMul computes, in numpy: the row's scale, its uint8 values, the exact integer product."""
    scale = np.maximum(np.abs(x).max(axis=-1, keepdims=True), TINY) * np.float32(1 / ACTIVATION_LIMIT)
    shifted = (np.rint(x / scale) + np.float32(ACTIVATION_ZERO)).astype(np.uint8)
    quantized, column_scales = quantized_columns(weight)
    integers = (shifted.astype(np.int64) - ACTIVATION_ZERO) @ quantized.astype(np.int64)
    return integers.astype(np.float32) * column_scales * scale


def _inputs(rows: int = ROWS, seed: int = 1) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((rows, 1, K)).astype(np.float32)
    x[2] = 0  # an all-zero row
    x[3] = 7.5  # every value the row's peak: uint8 255 against 63s, the int16 pairs' worst case
    x[4] *= 1e-20  # a tiny row
    return x


@pytest.mark.parametrize("opset", [17, 18])  # ReduceMax's axes: an attribute, then an input
def test_the_integer_gemm_computes_the_reference_exactly(opset):
    model, weights = _graph(opset)
    assert to_int8_rows(model) == 3 and has_integer_gemm(model)
    x = _inputs()
    a, b, c = _run(model, x)
    np.testing.assert_array_equal(a, _reference(x, weights["wa"]))
    np.testing.assert_array_equal(b, _reference(x, weights["wb"]))
    np.testing.assert_array_equal(c, _reference(np.maximum(a, 0), weights["wc"]))
    assert not np.any(a[2]) and np.isfinite(a).all() and np.isfinite(b).all()


def test_a_row_gives_the_same_bits_alone_and_in_any_batch():
    model, _ = _graph()
    to_int8_rows(model)
    x = _inputs(rows=33)
    together = _run(model, x)
    for row in (0, 3, 17, 32):
        alone = _run(model, x[row:row + 1])
        for t, a in zip(together, alone):
            np.testing.assert_array_equal(t[row], a[0])
    reordered = _run(model, x[::-1].copy())
    for t, r in zip(together, reordered):
        np.testing.assert_array_equal(t, r[::-1])


def test_each_activation_is_quantised_once_and_the_outputs_keep_their_names():
    model, _ = _graph()
    inputs, outputs = list(model.graph.input), list(model.graph.output)
    to_int8_rows(model)
    ops = [node.op_type for node in model.graph.node]
    assert ops.count("Abs") == 2 and ops.count(MATMUL_INTEGER_TO_FLOAT) == 3 and "MatMul" not in ops
    assert list(model.graph.input) == inputs and list(model.graph.output) == outputs
    onnx.checker.check_model(onnx.load_from_string(model.SerializeToString()))


def test_the_weights_are_seven_bit_per_column():
    weight = np.random.default_rng(2).standard_normal((K, N)).astype(np.float32)
    weight[:, 3] = 0
    quantized, scales = quantized_columns(weight)
    assert quantized.dtype == np.int8 and np.abs(quantized).max() == WEIGHT_LIMIT
    assert (np.abs(quantized).max(axis=0)[np.arange(N) != 3] == WEIGHT_LIMIT).all() and not quantized[:, 3].any()
    np.testing.assert_allclose(quantized * scales, weight, atol=float(scales.max()) / 2 + 1e-7)


def test_a_graph_without_a_constant_weight_is_left_alone():
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "y"], ["z"])], "g",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 2]) for n in "xy"],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 2])])
    model = ModelProto.FromString(helper.make_model(graph).SerializeToString())
    before = model.SerializeToString()
    assert to_int8_rows(model) == 0 and model.SerializeToString() == before


def test_an_all_zero_column_has_scale_one_and_the_others_their_peak_over_the_limit():
    weight = np.random.default_rng(3).standard_normal((K, N)).astype(np.float32)
    weight[:, 7] = 0
    _, scales = quantized_columns(weight)
    assert scales.dtype == np.float32 and scales[7] == np.float32(1)
    peaks = np.abs(weight).max(axis=0)
    others = np.arange(N) != 7
    np.testing.assert_array_equal(scales[others], (peaks / np.float32(WEIGHT_LIMIT))[others])


@pytest.mark.parametrize("kind", ["add", "gather", "matmul-3d", "other-domain"])
def test_only_default_domain_matmuls_of_a_two_dimensional_constant_are_rewritten(kind):
    """An Add or a Gather with a 2-D constant, a MatMul whose constant is 3-D, or a MatMul of another domain stay as
    they are; a MatMul of the default domain written `ai.onnx` is rewritten like one of `""`."""
    rng = np.random.default_rng(4)
    table = numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float32), "w")
    node = {"add": helper.make_node("Add", ["x", "w"], ["z"]),
            "gather": helper.make_node("Gather", ["w", "x"], ["z"]),
            "matmul-3d": helper.make_node("MatMul", ["x", "w"], ["z"]),
            "other-domain": helper.make_node("MatMul", ["x", "w"], ["z"], domain="com.example")}[kind]
    if kind == "matmul-3d":
        table = numpy_helper.from_array(rng.standard_normal((2, K, N)).astype(np.float32), "w")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], [table])
    model = ModelProto.FromString(helper.make_model(graph).SerializeToString())
    before = model.SerializeToString()
    assert to_int8_rows(model) == 0 and model.SerializeToString() == before
    aliased = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["z"], domain="ai.onnx")], "g",
                                [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
                                [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, N])],
                                [numpy_helper.from_array(rng.standard_normal((K, N)).astype(np.float32), "w")])
    model = ModelProto.FromString(helper.make_model(aliased).SerializeToString())
    assert to_int8_rows(model) == 1 and has_integer_gemm(model)


def test_every_node_of_the_rewritten_graph_has_its_own_name():
    """ONNX Runtime's profile and its errors name nodes: each quantiser, integer GEMM and row scale has a name of
    its own; and a graph is said to hold an integer GEMM only once rewritten."""
    model, _ = _graph()
    assert not has_integer_gemm(model)
    to_int8_rows(model)
    names = [node.name for node in model.graph.node]
    assert all(names) and len(set(names)) == len(names)


def test_the_variant_names_and_derivation():
    assert W.split_variant("int8rows+gqa+kv8") == (INT8_ROWS, "gqa+kv8") and INT8_ROWS in W.VARIANTS
    assert W.compute_weights(INT8_ROWS) == W.FP32  # never stored: derived from the float32 weights
    path = RELEASE_REPOSITORY / "vit" / str(ModelRepository(RELEASE_REPOSITORY).get("vit").version) / "model.onnx"
    derived = ModelProto.FromString(W.derive(path, INT8_ROWS, fuse=True))
    assert W.graph_weights(derived) == INT8_ROWS
    assert not any(node.op_type in ("MatMul", "MatMulNBits") and len(node.input) > 1 and
                   node.input[1].endswith(("_Q8", "__fp32")) for node in derived.graph.node)


def test_the_released_gpt_in_int8rows_stays_near_its_float32_logits():
    model = ModelRepository(RELEASE_REPOSITORY).get("gpt")
    rows = GPTEngine(model, RuntimeOptions(weights="int8rows+gqa"))
    exact = GPTEngine(model, RuntimeOptions(weights="fp32+gqa"))
    prompts = [rows.tokenizer.encode(text).ids for text in ("ROMEO:\nWhat say", "First Citizen:\nBefore we")]
    ours, _ = rows.prefill(prompts)
    reference, _ = exact.prefill(prompts)
    assert np.abs(ours - reference).max() < 0.5  # logits of magnitude ~10; the export check measures the loss
    assert (ours.argmax(-1) == reference.argmax(-1)).all()


def test_the_released_vit_in_int8rows_classifies_as_float32():
    model = ModelRepository(RELEASE_REPOSITORY).get("vit")
    rows, exact = ViTEngine(model, RuntimeOptions(weights=INT8_ROWS)), ViTEngine(model, RuntimeOptions(weights="fp32"))
    pixels = np.random.default_rng(3).random((8, rows.channels, rows.size, rows.size)).astype(np.float32)
    ours, reference = rows.logits(rows.normalize(pixels)), exact.logits(exact.normalize(pixels))
    assert np.abs(ours - reference).max() < 0.25 and (ours.argmax(-1) == reference.argmax(-1)).all()
    for row in (0, 5):  # and a row's logits are the same alone
        np.testing.assert_array_equal(rows.logits(rows.normalize(pixels[row:row + 1]))[0], ours[row])
