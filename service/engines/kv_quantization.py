"""An int8 KV cache for the GroupQueryAttention step graph: the `+gqa+kv8` variants (`service.engines.weights`).

ONNX Runtime's CPU `GroupQueryAttention` reads an int8 cache (`k_quant_type` / `v_quant_type` PER_CHANNEL,
`kv_cache_bit_width` 8, float scales `k_scale` / `v_scale` per head and channel): it quantises the new token's
keys and values into their slot itself and dequantises while it attends. A quarter of float32's bytes: from batch
16 on, a decoding step's attention is mostly reading the cache (docs/benchmarks.md, "An int8 KV cache").

The scales are static, one per layer, head and channel for keys and one for values: max |x| / 127 over a
calibration text, measured at export (`export.kv_scales`) and stored beside the graphs (`SCALES_FILE`, config.json
`kv_cache_scales`). A value past its channel's range saturates (-128 / 127). The prompt pass keeps its float32
graph; its presents are quantised here (`quantize`) by the kernel's own rule (x times 1 / scale, half to even, clamped), so a
prompt's slots hold what a step would have written for the same keys and values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from service.engines.onnx_graph import AttributeProto, ModelProto, TensorProto, from_array
from service.engines.onnx_schema import past_names, present_names

KV8 = "kv8"  # the variant suffix, after `+gqa`
SCALES_FILE = "kv_cache_scales.npy"  # (layers, 2: keys / values, heads, head_dim) float32, beside the graphs
LEVELS = 127  # scale = max |x| / LEVELS
LOWEST, HIGHEST = -128, 127  # what GroupQueryAttention clamps to
QUANT_TYPE = "PER_CHANNEL"
BIT_WIDTH = 8
GQA_PAST_KEY, GQA_K_SCALE, GQA_V_SCALE = 3, 12, 13  # GroupQueryAttention's inputs


def load_scales(directory: str | Path) -> np.ndarray:
    """The version's scales (`SCALES_FILE` in `directory`); ValueError naming the file when it is missing."""
    path = Path(directory) / SCALES_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing: an int8 KV cache ({KV8}) needs the scales `export.kv_scales` measures")
    try:
        scales = np.asarray(np.load(path, allow_pickle=False), dtype=np.float32)
    except (OSError, ValueError, EOFError, TypeError) as error:  # not a .npy file of numbers, or cut short
        raise ValueError(f"{path} is not a NumPy file of scales: {error}") from None
    if scales.ndim != 4 or scales.shape[1] != 2 or not (np.isfinite(scales) & (scales > 0)).all():
        raise ValueError(f"{path}: expected finite positive scales of shape (layers, 2, heads, head_dim), got "
                         f"{scales.shape}")
    return scales


def scales_from_peaks(peaks: np.ndarray) -> np.ndarray:
    """Max |x| per (layer, keys/values, head, channel) -> the scales (a channel that never moved gets 1)."""
    return np.where(peaks > 0, peaks / LEVELS, 1.0).astype(np.float32)


def quantize(presents: list[np.ndarray], scales: np.ndarray) -> list[np.ndarray]:
    """The prompt pass's float32 presents (layer 0 keys, layer 0 values, ...; each (rows, heads, slots, head_dim))
    as the int8 cache holds them, by the kernel's rule: x times the float32 reciprocal of its scale, rounded half to
    even, clamped to [-128, 127] (x / scale rounds otherwise at ties: tested against the kernel)."""
    quantized = []
    for index, present in enumerate(presents):
        reciprocal = (np.float32(1) / scales[index // 2, index % 2])[None, :, None, :]
        quantized.append(np.clip(np.rint(present * reciprocal), LOWEST, HIGHEST).astype(np.int8))
    return quantized


def quantize_step_cache(model: ModelProto, scales: np.ndarray) -> int:
    """In place: every GroupQueryAttention of a step graph reads and writes its layer's cache in int8 with the
    layer's `scales`, and the graph's past inputs and present outputs become int8. Returns how many layers."""
    graph = model.graph
    layer_of = {past_names(i)[0]: i for i in range(scales.shape[0])}
    cache_names = {name for i in range(scales.shape[0]) for name in (*past_names(i), *present_names(i))}
    rewritten = 0
    for node in graph.node:
        if node.op_type != "GroupQueryAttention" or len(node.input) <= GQA_PAST_KEY:
            continue
        layer = layer_of.get(node.input[GQA_PAST_KEY])
        if layer is None:
            raise ValueError(f"{node.name}: its past keys {node.input[GQA_PAST_KEY]!r} are no layer's cache input")
        names = [f"kv8/{layer}/key_scale", f"kv8/{layer}/value_scale"]
        graph.initializer.extend([from_array(scales[layer, 0], names[0]), from_array(scales[layer, 1], names[1])])
        inputs = list(node.input) + [""] * (GQA_V_SCALE + 1 - len(node.input))
        inputs[GQA_K_SCALE], inputs[GQA_V_SCALE] = names
        del node.input[:]
        node.input.extend(inputs)
        node.attribute.extend([AttributeProto(name="k_quant_type", type=AttributeProto.STRING, s=QUANT_TYPE.encode()),
                               AttributeProto(name="v_quant_type", type=AttributeProto.STRING, s=QUANT_TYPE.encode()),
                               AttributeProto(name="kv_cache_bit_width", type=AttributeProto.INT, i=BIT_WIDTH)])
        rewritten += 1
    if rewritten != scales.shape[0]:
        raise ValueError(f"the step graph has {rewritten} GroupQueryAttention layers, the scales {scales.shape[0]}")
    for value in (*graph.input, *graph.output):
        if value.name in cache_names:
            value.type.tensor_type.elem_type = TensorProto.INT8
    return rewritten
