"""The `int8rows` weights: every MatMul with a constant weight runs on ONNX Runtime's integer GEMM (MLAS QGEMM, u8 x s8,
the kernels it has for AVX2, AVX-512 VNNI and AMX) with its activations quantised row by row, so that a row's output
depends on that row alone, as `MatMulNBits`' does (batch invariance) and unlike `quantize_dynamic`'s one scale per
tensor.

Per activation tensor x (..., K), once however many MatMuls read it: s = max(|x| over K, TINY) / 127 per row,
u = round(x / s) + 128 as uint8; per MatMul: `com.microsoft.MatMulIntegerToFloat(u, Wq, 1, w_scale, 128)` computes
(u - 128) . Wq x w_scale[n] in int32 then float, exactly, and a `Mul` by s finishes the row. The weight: per output
column symmetric, Wq = round(W / w_scale) with |Wq| <= WEIGHT_LIMIT = 63, 7 bits as ONNX Runtime's quantiser's
`reduce_range`: u8 x s8 pairs summed in int16 (VPMADDUBSW, the AVX2 and AVX-512BW kernels) then cannot saturate, so the
integer products are exact on every x86 CPU and the same integers come out on all of them.

Cost: 8 element-wise nodes per quantised activation and 2 per MatMul besides the GEMM; docs/benchmarks.md has where
that pays (large batches, prompt passes) and where it does not (a decoding step at batch 1).
"""

from __future__ import annotations

import numpy as np

from service.engines.onnx_graph import (MICROSOFT_DOMAIN, AttributeProto, ModelProto, NodeProto, TensorProto,
                                        default_opset, drop_unread_initializers, float_constants, from_array,
                                        make_node, to_float32)

INT8_ROWS = "int8rows"
MATMUL_INTEGER_TO_FLOAT = "MatMulIntegerToFloat"
ACTIVATION_LIMIT = 127  # |round(x / s)| <= 127: the row's largest magnitude maps to 127
ACTIVATION_ZERO = 128  # the uint8 offset of a symmetric activation (MatMulIntegerToFloat's a_zero_point)
WEIGHT_LIMIT = 63  # 7-bit weights: no int16 saturation in the u8 x s8 kernels without VNNI
TINY = np.float32(1e-30)  # the scale of an all-zero row (its quantised values are 0 whatever the scale)
AXES_INPUT_OPSET = 18  # from this opset on, ReduceMax takes its axes as an input, not an attribute
_CONSTANTS = {"int8rows_last_axis": np.array([-1], np.int64),
              "int8rows_tiny": np.array(TINY, np.float32),
              "int8rows_inverse_limit": np.array(1 / ACTIVATION_LIMIT, np.float32),
              "int8rows_zero": np.array(ACTIVATION_ZERO, np.float32),
              "int8rows_zero_u8": np.array(ACTIVATION_ZERO, np.uint8),
              "int8rows_one": np.array(1.0, np.float32)}


def quantized_columns(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float (K, N) weight as int8 (K, N) with |q| <= WEIGHT_LIMIT and one float32 scale per column (N,)."""
    peak = np.abs(weight).max(axis=0).astype(np.float32)
    scale = np.where(peak > 0, peak / np.float32(WEIGHT_LIMIT), np.float32(1)).astype(np.float32)
    quantized = np.clip(np.rint(weight / scale), -WEIGHT_LIMIT, WEIGHT_LIMIT).astype(np.int8)
    return quantized, scale


def has_integer_gemm(model: ModelProto) -> bool:
    return any(node.op_type == MATMUL_INTEGER_TO_FLOAT for node in model.graph.node)


def to_int8_rows(model: ModelProto) -> int:
    """Replace every MatMul whose weight is a constant 2-D float matrix with the per-row integer GEMM above, in place;
    returns how many were replaced. The graph's inputs and outputs keep their names and types."""
    graph = model.graph
    constants = float_constants(model)
    rows: dict[str, tuple[str, str]] = {}  # activation -> (its uint8 rows, its row scales)
    nodes: list[NodeProto] = []
    replaced = 0
    for node in graph.node:
        tensor = constants.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if tensor is None or len(tensor.dims) != 2 or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        activation = node.input[0]
        if activation not in rows:
            quantizers, rows[activation] = _row_quantizer(activation, default_opset(model) >= AXES_INPUT_OPSET)
            nodes.extend(quantizers)
        quantized_rows, row_scales = rows[activation]
        weight, column_scales = quantized_columns(to_float32(tensor))
        base = f"{node.input[1]}__int8rows"
        graph.initializer.extend([from_array(weight, base), from_array(column_scales, f"{base}_scales")])
        output = node.output[0]
        nodes.append(make_node(MATMUL_INTEGER_TO_FLOAT,
                               [quantized_rows, base, "int8rows_one", f"{base}_scales", "int8rows_zero_u8"],
                               [f"{output}__columns"], f"{node.name}__int8rows", MICROSOFT_DOMAIN))
        nodes.append(make_node("Mul", [f"{output}__columns", row_scales], [output], f"{node.name}__row_scale"))
        replaced += 1
    if not replaced:
        return 0
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(from_array(value, name) for name, value in _CONSTANTS.items())
    if not any(o.domain == MICROSOFT_DOMAIN for o in model.opset_import):
        model.opset_import.add(domain=MICROSOFT_DOMAIN, version=1)
    drop_unread_initializers(model)
    return replaced


def _row_quantizer(x: str, axes_input: bool) -> tuple[list[NodeProto], tuple[str, str]]:
    """The nodes that quantise `x` row by row: (nodes, (uint8 rows name, row scales name))."""
    p = f"{x}__int8rows"
    peak = make_node("ReduceMax", [f"{p}_abs", *(["int8rows_last_axis"] if axes_input else [])], [f"{p}_peak"],
                     f"{p}_peak", keepdims=1)
    if not axes_input:
        peak.attribute.append(AttributeProto(name="axes", type=AttributeProto.INTS, ints=[-1]))
    nodes = [make_node("Abs", [x], [f"{p}_abs"], f"{p}_abs"),
             peak,
             make_node("Max", [f"{p}_peak", "int8rows_tiny"], [f"{p}_peak_or_tiny"], f"{p}_peak_or_tiny"),
             make_node("Mul", [f"{p}_peak_or_tiny", "int8rows_inverse_limit"], [f"{p}_scale"], f"{p}_scale"),
             make_node("Div", [x, f"{p}_scale"], [f"{p}_scaled"], f"{p}_scaled"),
             make_node("Round", [f"{p}_scaled"], [f"{p}_rounded"], f"{p}_rounded"),
             make_node("Add", [f"{p}_rounded", "int8rows_zero"], [f"{p}_offset"], f"{p}_offset"),
             make_node("Cast", [f"{p}_offset"], [f"{p}_u8"], f"{p}_u8", to=TensorProto.UINT8)]
    return nodes, (f"{p}_u8", f"{p}_scale")
