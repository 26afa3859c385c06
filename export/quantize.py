"""int8 weights: weight-only 8-bit quantisation of the MatMul weights into ONNX Runtime's `MatMulNBits`.

Follows ONNX Runtime's "Quantize ONNX models" guide (weight-only quantisation,
https://onnxruntime.ai/docs/performance/model-optimizations/quantization.html) with its `MatMulNBitsQuantizer`:
every MatMul with a constant weight becomes a `com.microsoft.MatMulNBits` node with 8-bit symmetric weights in
blocks of `BLOCK_SIZE` along the input dimension, one float scale per block; `accuracy_level` 4 lets the CPU
kernel quantise the activations to int8 block by block, per row, and run the VNNI int8 dot products.

Why not `quantize_dynamic` (MatMulInteger / DynamicQuantizeMatMul): it quantises the activations with one scale for
the whole input tensor, i.e. over every row of the batch, so a request's logits (and its greedy tokens) depend on
which other requests share its batch: measured on the release GPT, 2 of 16 greedy tokens changed between a
batch of 16 and the same rows alone. `MatMulNBits` scales each row's blocks separately: a row alone and in any
batch computes bit-identical logits (tests/export/test_release_models.py), at the same speed and with a smaller quality
change (release GPT validation loss: float32 1.5291, MatMulNBits 1.5291, dynamic int8 1.5293).

Embeddings, biases and LayerNorm stay float (the large ones stored as float16, `export.compress`).
`MatMulNBitsQuantizer` needs float32 initializers, so the float16 storage of `export.compress` is undone first.
Quality is the caller's to measure (`export.convert`, `export.repository`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
from onnx import TensorProto, numpy_helper

from export.compress import store_weights_as_fp16
# the int8 format, one definition for the exporter and the service's load-time derivation (BLOCK_SIZE weights per
# scale along the input dimension K; accuracy level 4: int8 activations per row and block, int8 dot products)
from service.engines.weights import ACCURACY_LEVEL, BITS, BLOCK_SIZE


def _cast_target(node: onnx.NodeProto) -> int:
    return next(a.i for a in node.attribute if a.name == "to")


def unfold_fp16_storage(model: onnx.ModelProto) -> int:
    """Turn each float16 initializer read only through a `Cast(to=float)` back into a float32 initializer named
    as the Cast's output (what `store_weights_as_fp16` undone looks like); returns how many were folded."""
    graph = model.graph
    halves = {i.name: i for i in graph.initializer if i.data_type == TensorProto.FLOAT16}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    folds = [node for node in graph.node if node.op_type == "Cast" and node.input[0] in halves
             and readers[node.input[0]] == 1 and _cast_target(node) == TensorProto.FLOAT]
    for node in folds:
        half = halves[node.input[0]]
        graph.initializer.remove(half)
        graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(half).astype("float32"),
                                                         node.output[0]))
        graph.node.remove(node)
    return len(folds)


def _quantizer_class():
    """ONNX Runtime's `MatMulNBitsQuantizer` (needs onnx-ir), imported without the `logging.basicConfig(level=INFO)`
    its module runs on import: that would configure the root logger of whoever exports (every node it visits
    logged at INFO, in the CLI and in the benchmarks' servers alike)."""
    root = logging.getLogger()
    placeholder = None if root.handlers else logging.NullHandler()  # basicConfig does nothing once one exists
    if placeholder is not None:
        root.addHandler(placeholder)
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    finally:
        if placeholder is not None:
            root.removeHandler(placeholder)
    return MatMulNBitsQuantizer


def quantize_int8(path: Path) -> tuple[int, int]:
    """Rewrite the ONNX file at `path` in place with 8-bit MatMul weights; returns (bytes before, bytes after)."""
    before = path.stat().st_size
    model = onnx.load(str(path))
    unfold_fp16_storage(model)
    quantizer = _quantizer_class()(model, bits=BITS, block_size=BLOCK_SIZE, is_symmetric=True,
                                   accuracy_level=ACCURACY_LEVEL)
    quantizer.process()
    onnx.save(quantizer.model.model, str(path))
    store_weights_as_fp16(path)  # the embeddings and biases left in float32; runs onnx.checker (full check)
    return before, path.stat().st_size
