"""The weights variants of a graph, derived when it loads: a graph stored with one kind of MatMul weights runs with
another, so that the repository stores each model once and the service runs the variant its provider is fastest with
(`service.models.variants` measures and chooses).

- `fp32`: every MatMul computes in float32 on float32 weights (stored as float32 or as float16, `export.compress`);
- `int8`: every MatMul with a constant weight is ONNX Runtime's `com.microsoft.MatMulNBits` (8-bit symmetric blocks
  of `BLOCK_SIZE`, `accuracy_level` 4): what `export.quantize` stores;
- `int8rows`: every such MatMul on ONNX Runtime's integer GEMM with activations quantised per row
  (`service.engines.integer_gemm`), derived from the float32 weights after the projections are fused;
- `fp16` (`FLOAT16_VARIANTS`, for CUDA): the `fp32` graph computing in float16 (`service.engines.float16`);
- `+gqa`, `+gqa+kv8`: the in-place step graph's attention as GroupQueryAttention
  (`service.engines.step_attention`), with `+kv8` over an int8 cache (`service.engines.kv_quantization`).
`derive` dequantises (int8 -> fp32), quantises with ONNX Runtime's own blockwise kernel (fp32 -> int8) or converts to
float16 last. Invariant: the graph's inputs and outputs keep their names and types. `VARIANTS`' quality is measured
at export (`export.variants`); `FLOAT16_VARIANTS`' by tests/gpu (docs/architecture.md says why).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from onnxruntime.capi._pybind_state import quantize_matmul_8bits

from service.engines.onnx_graph import (MATMUL_NBITS, MICROSOFT_DOMAIN, NBITS_A, NBITS_B, NBITS_BIAS, NBITS_G_IDX,
                                        NBITS_SCALES, NBITS_ZERO_POINTS, ModelProto, attribute,
                                        drop_unread_initializers, float_constants, from_array, load, make_node,
                                        to_array, to_float32)
from service.engines.float16 import to_float16
from service.engines.integer_gemm import INT8_ROWS, has_integer_gemm, to_int8_rows
from service.engines.kv_quantization import KV8, SCALES_FILE, load_scales, quantize_step_cache
from service.engines.projection_fusion import fuse_projections
from service.engines.row_candidates import add_row_candidates, has_row_candidates
from service.engines.step_attention import (GQA, has_masked_step_attention, pack_query_key_value,
                                            to_group_query_attention)

FP32, INT8, FP16 = "fp32", "int8", "fp16"
WEIGHTS = (FP32, INT8)  # what a repository stores (config.json `weights`; float16 storage computes in float32)
VARIANT_SEPARATOR = "+"
# the step graph's attention: GroupQueryAttention over the float32 cache, or over an int8 one
GQA_KV8 = f"{GQA}{VARIANT_SEPARATOR}{KV8}"
ATTENTIONS = (GQA, GQA_KV8)
# the weights a graph is derived in (`int8rows` is never stored: it is derived from the float32 weights)
DERIVED_WEIGHTS = (*WEIGHTS, INT8_ROWS)
# the variants `export.variants` checks on the exporting CPU
VARIANTS = (*DERIVED_WEIGHTS, *(f"{weights}{VARIANT_SEPARATOR}{attention}" for attention in ATTENTIONS
                                for weights in DERIVED_WEIGHTS))
# float16 computation, for CUDA (`service.models.variants` offers them there only); no `+gqa+kv8`: ONNX Runtime
# 1.31's CUDA GroupQueryAttention over an int8 cache with per-channel scales is unverified here
FLOAT16_VARIANTS = (FP16, f"{FP16}{VARIANT_SEPARATOR}{GQA}")
ALL_VARIANTS = (*VARIANTS, *FLOAT16_VARIANTS)
BITS = 8
BLOCK_SIZE = 32
ACCURACY_LEVEL = 4  # int8 activations per row and block, int8 dot products
# derived graphs kept in memory: an engine builds a wide and a one-thread session of one graph in a row
DERIVED_GRAPHS_KEPT = 2


def compute_weights(stored: str) -> str:
    """The weights variant a repository config's `weights` computes with: float16 storage computes in float32."""
    return INT8 if stored == INT8 else FP32


def split_variant(variant: str) -> tuple[str, str | None]:
    """'int8+gqa' -> ('int8', 'gqa'); 'int8+gqa+kv8' -> ('int8', 'gqa+kv8'); 'fp32' -> ('fp32', None);
    ValueError for a name not in `ALL_VARIANTS`."""
    if variant not in ALL_VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(ALL_VARIANTS)}, got {variant!r}")
    weights, _, attention = variant.partition(VARIANT_SEPARATOR)
    return weights, attention or None


def changes_step_attention(variant: str | None) -> bool:
    """Whether `variant` (None: as stored) runs the step graph's attention as GroupQueryAttention (`+gqa`,
    `+gqa+kv8`)."""
    return variant is not None and split_variant(variant)[1] is not None


def quantizes_kv_cache(variant: str | None) -> bool:
    """Whether `variant` (None: as stored) keeps the step graph's cache in int8 (`+gqa+kv8`,
    `service.engines.kv_quantization`)."""
    return variant is not None and split_variant(variant)[1] == GQA_KV8


def graph_weights(model: ModelProto) -> str:
    """`int8` if any MatMul of the graph is a MatMulNBits, `int8rows` if any runs on the integer GEMM, else `fp32`."""
    if any(node.op_type == MATMUL_NBITS for node in model.graph.node):
        return INT8
    return INT8_ROWS if has_integer_gemm(model) else FP32


@functools.lru_cache(maxsize=DERIVED_GRAPHS_KEPT)
def _derived(path: str, mtime_ns: int, size: int, variant: str | None, row_candidates: bool,
             fuse: bool, scales_stamp: tuple[int, int] | None) -> bytes | None:
    model = load(path)
    changed = False
    weights, attention = split_variant(variant) if variant is not None else (None, None)
    in_place_step = attention is not None and has_masked_step_attention(model)
    if in_place_step:
        to_group_query_attention(model)
        changed = True
    # float16 is converted from the float32 graph, last; int8rows quantised from it after the projections are fused
    matmuls = FP32 if weights in (FP16, INT8_ROWS) else weights
    if matmuls is not None and graph_weights(model) != matmuls:
        rewritten = to_fp32(model) if matmuls == FP32 else to_int8(model)
        if weights == INT8 and rewritten == 0:
            raise ValueError(f"{path}: no MatMul with a constant 2-D float weight to quantise")
        changed = True
    if row_candidates and not has_row_candidates(model):
        add_row_candidates(model)
        changed = True
    if fuse and fuse_projections(model):
        changed = True
        if attention is not None:
            pack_query_key_value(model)
    if weights == INT8_ROWS and not has_integer_gemm(model):
        if to_int8_rows(model) == 0:
            raise ValueError(f"{path}: no MatMul with a constant 2-D float weight to quantise")
        changed = True
    if in_place_step and quantizes_kv_cache(variant):
        quantize_step_cache(model, load_scales(Path(path).parent))
    if weights == FP16:
        to_float16(model)
        changed = True
    return model.SerializeToString() if changed else None


def derive(path: str | Path, variant: str | None, row_candidates: bool = False, fuse: bool = False) -> bytes | None:
    """The graph at `path` serialized in `variant` (`ALL_VARIANTS`; None: as stored), with the decoder's row
    candidates added when asked (`service.engines.row_candidates`) and with `fuse` its sibling projections fused
    (`service.engines.projection_fusion`), or None when the stored graph is that already. A graph derived once is
    kept (`DERIVED_GRAPHS_KEPT`) while its file (and, for `+gqa+kv8`, the scales file beside it) is unchanged."""
    if variant is not None:
        split_variant(variant)  # a clear error for an unknown name
    stat = Path(path).stat()
    scales_stamp = None
    scales = Path(path).parent / SCALES_FILE
    if quantizes_kv_cache(variant) and scales.is_file():
        scales_stat = scales.stat()
        scales_stamp = (scales_stat.st_mtime_ns, scales_stat.st_size)
    return _derived(str(path), stat.st_mtime_ns, stat.st_size, variant, row_candidates, fuse, scales_stamp)


# --- int8 -> fp32 ---------------------------------------------------------------------------------------------

def dequantized_weight(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, n: int,
                       bits: int, block_size: int) -> np.ndarray:
    """MatMulNBits' weight as the float32 (K, N) matrix it stands for: (q - zero point) x scale per block, q read
    from `packed` (N, blocks, block_size x bits / 8) uint8, low bits first; zero point 2^(bits-1) when none."""
    if bits not in (4, 8):
        raise ValueError(f"MatMulNBits with {bits}-bit weights is not supported (4 or 8)")
    blocks = -(-k // block_size)
    q = packed.reshape(n, -1)
    if bits == 4:
        q = np.stack([q & 0x0F, q >> 4], axis=-1).reshape(n, -1)
    q = q[:, : blocks * block_size].reshape(n, blocks, block_size).astype(np.float32)
    if zero_points is None:
        zero = np.float32(1 << (bits - 1))
    else:
        zp = zero_points.reshape(n, -1)
        if bits == 4:
            zp = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, -1)
        zero = zp[:, :blocks, None].astype(np.float32)
    weight = (q - zero) * scales.reshape(n, blocks)[:, :, None].astype(np.float32)
    return np.ascontiguousarray(weight.reshape(n, blocks * block_size)[:, :k].T)


def to_fp32(model: ModelProto) -> int:
    """Replace every MatMulNBits with a float32 MatMul on its dequantised weights (+ Add of its bias), in place;
    returns how many were replaced."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    constants = float_constants(model)
    replaced = 0
    for index in range(len(graph.node) - 1, -1, -1):
        node = graph.node[index]
        if node.op_type != MATMUL_NBITS:
            continue
        inputs = list(node.input) + [""] * (NBITS_BIAS + 1 - len(node.input))
        if inputs[NBITS_G_IDX]:
            raise ValueError(f"{node.name}: MatMulNBits with g_idx (act-order) is not supported")
        packed, zero_points = (initializers.get(inputs[i]) for i in (NBITS_B, NBITS_ZERO_POINTS))
        scales = constants.get(inputs[NBITS_SCALES])
        if packed is None or scales is None or (inputs[NBITS_ZERO_POINTS] and zero_points is None):
            raise ValueError(f"{node.name}: MatMulNBits whose weights are not constants")
        weight = dequantized_weight(to_array(packed), to_float32(scales),
                                    None if zero_points is None else to_array(zero_points),
                                    attribute(node, "K"), attribute(node, "N"), attribute(node, "bits"),
                                    attribute(node, "block_size"))
        name = f"{inputs[NBITS_B]}__fp32"
        graph.initializer.append(from_array(weight, name))
        output = node.output[0]
        new = [make_node("MatMul", [inputs[NBITS_A], name], [f"{output}__matmul" if inputs[NBITS_BIAS] else output],
                         f"{node.name}__fp32")]
        if inputs[NBITS_BIAS]:
            new.append(make_node("Add", [new[0].output[0], inputs[NBITS_BIAS]], [output], f"{node.name}__bias"))
        del graph.node[index]
        for offset, added in enumerate(new):
            graph.node.insert(index + offset, added)
        replaced += 1
    drop_unread_initializers(model)
    return replaced


# --- fp32 -> int8 ---------------------------------------------------------------------------------------------

def quantized_weight(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A float (K, N) weight as MatMulNBits' symmetric 8-bit blocks: packed (N, blocks, BLOCK_SIZE) uint8 and scales
    (N, blocks) float32, by ONNX Runtime's kernel called as its quantiser calls it (the last block's slots past K
    left zero; the exporter then stores large scale tensors as float16, `export.compress`: here they stay float32)."""
    k, n = weight.shape
    blocks = -(-k // BLOCK_SIZE)
    padded = np.zeros((blocks * BLOCK_SIZE, n), np.float32)
    padded[:k] = weight
    packed = np.zeros((n, blocks, BLOCK_SIZE * BITS // 8), np.uint8)
    scales = np.zeros((n, blocks), np.float32)
    zero_points = np.zeros((n, blocks), np.uint8)  # written by the kernel, unused: symmetric blocks have none
    quantize_matmul_8bits(packed, padded, scales, zero_points, BLOCK_SIZE, n, k, True)
    return packed, scales


def to_int8(model: ModelProto) -> int:
    """Replace every MatMul whose weight is a constant 2-D float matrix with a MatMulNBits on its 8-bit blocks, in
    place (what `export.quantize` does from float32 weights); returns how many were replaced."""
    graph = model.graph
    constants = float_constants(model)
    replaced = 0
    for index, node in enumerate(graph.node):
        tensor = constants.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if tensor is None or len(tensor.dims) != 2 or node.domain not in ("", "ai.onnx"):
            continue
        weight = to_float32(tensor)
        packed, scales = quantized_weight(weight)
        base = node.input[1]
        graph.initializer.extend([from_array(packed, f"{base}_Q{BITS}"), from_array(scales, f"{base}_scales")])
        k, n = weight.shape
        quantized = make_node(MATMUL_NBITS, [node.input[0], f"{base}_Q{BITS}", f"{base}_scales"], list(node.output),
                              f"{node.name}_Q{BITS}", MICROSOFT_DOMAIN, K=k, N=n, bits=BITS, block_size=BLOCK_SIZE,
                              accuracy_level=ACCURACY_LEVEL)
        graph.node[index].CopyFrom(quantized)
        replaced += 1
    if replaced and not any(o.domain == MICROSOFT_DOMAIN for o in model.opset_import):
        model.opset_import.add(domain=MICROSOFT_DOMAIN, version=1)
    drop_unread_initializers(model)
    return replaced
