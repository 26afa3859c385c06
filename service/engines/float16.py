"""A graph computing in float16: the load-time rewrite of the `fp16` variants (`service.engines.weights`), after ONNX
Runtime's `onnxruntime.transformers.float16.convert_float_to_float16` (its op block list, its clamping of constants
into float16's range, its `keep_io_types`), on the service's own protobuf module instead of the onnx package.

Every float32 constant (initializers, Constant nodes, Casts to float) becomes float16 and every op computes in
float16, except `FLOAT32_OPS`, which keep float32 inputs and outputs with Casts around them. The graph's inputs and
outputs keep their names and float32 type, with a Cast at the boundary: the engines (float32 logits, the host's
float32 KV cache) are unchanged.

Invariant: only element types change; every op reads what it read before, through a Cast where the type differs.
ONNX Runtime's CPU provider lacks float16 kernels for most ops: such a graph runs on CUDA (`service.models.variants`).

Design notes: docs/architecture.md, service/engines/float16.py.
"""

from __future__ import annotations

import numpy as np

from service.engines.onnx_graph import (AttributeProto, ModelProto, NodeProto, TensorProto, from_array, make_node,
                                        to_array)

__all__ = ["FLOAT32_OPS", "element_types", "float16_array", "logits_tolerance", "to_float16"]

FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16
# ONNX Runtime's converter's DEFAULT_OP_BLOCK_LIST, those of it a Transformer graph may hold (the rest are ONNX-ML's
# classical operators), and LogSoftmax: the row candidates' log-probabilities (`service.engines.row_candidates`) add
# up over a whole sentence into a beam's score
FLOAT32_OPS = frozenset({"TopK", "Range", "CumSum", "Min", "Max", "NonMaxSuppression", "RoiAlign", "Upsample",
                         "RandomUniformLike", "LogSoftmax"})
# ops that read an input of any type: it is taken as it is, never cast
ANY_TYPE_INPUTS = frozenset({"Cast", "Shape", "Size"})
# inputs that stay float32 whatever the op computes in (op -> input positions): GroupQueryAttention's int8-cache
# scales, Resize's scales (ONNX Runtime's converter's ALWAYS_FLOAT_INPUTS)
FLOAT32_INPUTS = {"GroupQueryAttention": (12, 13), "Resize": (2,)}
# float16's range as the converter clamps to: the largest finite value, the smallest positive (subnormal) one; a
# float32 constant beyond it (the attention masks' -3.4e38) becomes the nearest end instead of an infinity or zero
FLOAT16_MAX, FLOAT16_TINY = 65504.0, 5.96e-08
# float16's unit roundoff (11 significant bits): each value rounded to float16 moves by at most this, relatively
UNIT_ROUNDOFF = 2.0 ** -11
# the allowance over the error model of `logits_tolerance`: a bound, not the typical value (the tiny GPT's float16
# weights alone moved its logits by ~1/20 of it on the CPU; the release GPT's: 0.0047 of logits up to 14.8)
ROUNDING_ALLOWANCE = 4
SUFFIX = {FLOAT: "__fp32", FLOAT16: "__fp16"}  # of a tensor's other-typed copy, made by a Cast
# the element type of outputs that do not follow their first input (op -> output position -> type)
BOOL_OPS = frozenset({"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor",
                      "IsNaN", "IsInf"})
INT64_OPS = frozenset({"Shape", "Size", "ArgMax", "ArgMin", "NonZero"})
FIXED_OUTPUTS = {"TopK": {1: TensorProto.INT64}, "LayerNormalization": {1: FLOAT, 2: FLOAT}}  # indices; mean, 1/std
TYPE_FROM_INPUT = {"Where": 1}  # the input the outputs take their type from, where not the first


def float16_array(values: np.ndarray) -> np.ndarray:
    """float32 values as float16, clamped as ONNX Runtime's converter does: finite or infinite magnitudes above
    `FLOAT16_MAX` to it, nonzero ones below `FLOAT16_TINY` up to it (an epsilon must not become 0)."""
    values = np.asarray(values, np.float32)
    clamped = np.clip(values, -FLOAT16_MAX, FLOAT16_MAX)
    tiny = (clamped != 0) & (np.abs(clamped) < FLOAT16_TINY)
    return np.where(tiny, np.copysign(np.float32(FLOAT16_TINY), clamped), clamped).astype(np.float16)


def logits_tolerance(n_layers: int, scale: float) -> float:
    """How far a float16 graph's logits may be from its float32 graph's, whose largest magnitude is `scale`: a
    Pre-LN Transformer's residual stream is rounded to float16 (relative error <= `UNIT_ROUNDOFF`) at the embeddings
    and after each block's attention and MLP, 2 x layers + 1 independent roundings adding up as a random walk (the
    weights' rounding is one more of the same size per layer, inside the same count; float32 accumulation on the
    GPU, so no growth with the dot products' length): sqrt(2 x layers + 1) x u x scale, times
    `ROUNDING_ALLOWANCE`."""
    return ROUNDING_ALLOWANCE * float(np.sqrt(2 * n_layers + 1)) * UNIT_ROUNDOFF * scale


def _float16_tensor(tensor: TensorProto) -> TensorProto:
    return from_array(float16_array(to_array(tensor)), tensor.name)


def _constant_type(node: NodeProto) -> int:
    for a in node.attribute:
        if a.name == "value":
            return a.t.data_type
        if a.name in ("value_float", "value_floats"):
            return FLOAT
        if a.name in ("value_int", "value_ints"):
            return TensorProto.INT64
    raise ValueError(f"{node.name}: a Constant without a tensor, float or int value is not supported here")


def element_types(model: ModelProto) -> dict[str, int]:
    """The element type (TensorProto.DataType) of every tensor of the graph: its inputs' and initializers' as
    declared, each node's outputs' by its op's rule (most ops: their first input's)."""
    graph = model.graph
    types = {i.name: i.type.tensor_type.elem_type for i in graph.input}
    types.update({t.name: t.data_type for t in graph.initializer if t.name not in types})
    for node in graph.node:
        op, fixed = node.op_type, FIXED_OUTPUTS.get(node.op_type, {})
        if op == "Cast":
            first = next(a.i for a in node.attribute if a.name == "to")
        elif op == "Constant":
            first = _constant_type(node)
        elif op == "ConstantOfShape":
            first = next((a.t.data_type for a in node.attribute if a.name == "value"), FLOAT)
        elif op in BOOL_OPS or op in INT64_OPS:
            first = TensorProto.BOOL if op in BOOL_OPS else TensorProto.INT64
        else:
            source = node.input[TYPE_FROM_INPUT.get(op, 0)] if node.input else ""
            if source not in types:
                raise ValueError(f"{node.name} ({op}): the type of its input {source!r} is unknown")
            first = types[source]
        for index, name in enumerate(node.output):
            if name:
                types[name] = fixed.get(index, first)
    return types


def _wanted(node: NodeProto, index: int) -> int | None:
    """The float type `node` reads its `index`th input in once converted, or None for an input of any type."""
    if node.op_type in ANY_TYPE_INPUTS:
        return None
    if node.op_type in FLOAT32_OPS or index in FLOAT32_INPUTS.get(node.op_type, ()):
        return FLOAT
    return FLOAT16


def _convert_constants(node: NodeProto) -> None:
    """A node's own float32 constants as float16: a Cast to float, a Constant's or ConstantOfShape's value."""
    for a in node.attribute:
        if node.op_type == "Cast" and a.name == "to" and a.i == FLOAT:
            a.i = FLOAT16
        elif node.op_type in ("Constant", "ConstantOfShape") and a.name == "value" and a.t.data_type == FLOAT:
            a.t.CopyFrom(_float16_tensor(a.t))
        elif node.op_type == "Constant" and a.name in ("value_float", "value_floats"):
            values = np.array(a.f if a.name == "value_float" else list(a.floats), np.float32)
            a.CopyFrom(AttributeProto(name="value", type=AttributeProto.TENSOR, t=from_array(float16_array(values),
                                                                                             "value")))


def to_float16(model: ModelProto) -> int:
    """In place: the graph computes in float16 (the module's docstring says how); returns how many initializers
    became float16. Its float32 inputs and outputs keep their names and type."""
    graph = model.graph
    types = element_types(model)
    floats = {name for name, kind in types.items() if kind == FLOAT}
    inputs = {i.name for i in graph.input}
    outputs = {o.name for o in graph.output}
    readers: dict[str, list[NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    # the type each float tensor has once converted: a graph input keeps float32, as does what a FLOAT32_OPS node
    # writes and an initializer only such nodes read; everything else becomes float16
    produced = {name: FLOAT for name in inputs & floats}
    converted = 0
    for index, tensor in enumerate(graph.initializer):
        if tensor.name in floats and tensor.name not in inputs:
            wanted = {_wanted(r, i) for r in readers.get(tensor.name, []) for i, n in enumerate(r.input)
                      if n == tensor.name}
            produced[tensor.name] = FLOAT16 if FLOAT16 in wanted else FLOAT
            if produced[tensor.name] == FLOAT16:
                graph.initializer[index].CopyFrom(_float16_tensor(tensor))
                converted += 1
    for node in graph.node:
        blocked, fixed = node.op_type in FLOAT32_OPS, FIXED_OUTPUTS.get(node.op_type, {})
        for index, name in enumerate(node.output):
            if name in floats:
                produced[name] = FLOAT if blocked or fixed.get(index) == FLOAT else FLOAT16
        if not blocked:
            _convert_constants(node)
    # each tensor's copy of each type its readers want: the tensor itself in its own type (a graph output that
    # became float16 is renamed, its name going to its float32 copy), else a Cast of it
    names: dict[str, dict[int, str]] = {}
    casts: dict[str, list[NodeProto]] = {}  # tensor -> the Casts of it, placed after its producer
    renamed: dict[str, str] = {}

    def copy(name: str, kind: int) -> str:
        own = produced[name]
        versions = names.setdefault(name, {own: name})
        if name in outputs and own != FLOAT and name not in renamed:
            renamed[name] = versions[own] = name + SUFFIX[own]
        if kind not in versions:
            versions[kind] = name if name in outputs and kind == FLOAT else name + SUFFIX[kind]
            casts.setdefault(name, []).append(make_node("Cast", [versions[own]], [versions[kind]],
                                                        f"{versions[kind]}/Cast", to=kind))
        return versions[kind]

    for node in graph.node:
        for index, name in enumerate(node.input):
            kind = _wanted(node, index)
            if name in produced and kind is not None:
                node.input[index] = copy(name, kind)
    for name in outputs & set(produced):
        copy(name, FLOAT)
    for node in graph.node:
        for index, name in enumerate(node.output):
            node.output[index] = renamed.get(name, name)
    original = {new: name for name, new in renamed.items()}
    constants = inputs | {t.name for t in graph.initializer}
    nodes = [cast for name in casts if name in constants for cast in casts[name]]
    for node in graph.node:
        nodes.append(node)
        nodes.extend(cast for name in node.output for cast in casts.get(original.get(name, name), []))
    del graph.node[:]
    graph.node.extend(_without_identity_casts(nodes, {**types, **produced}, outputs))
    kept = [v for v in graph.value_info if v.name not in floats]  # a float tensor's recorded type is no more
    del graph.value_info[:]
    graph.value_info.extend(kept)
    return converted


def _without_identity_casts(nodes: list[NodeProto], types: dict[str, int], outputs: set[str]) -> list[NodeProto]:
    """`nodes` less the Casts to the type their input already has (a float16-stored weight's Cast, now to float16),
    their readers reading that input instead."""
    alias: dict[str, str] = {}
    kept = []
    for node in nodes:
        for index, name in enumerate(node.input):
            node.input[index] = alias.get(name, name)
        to = next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" else None
        if to is not None and types.get(node.input[0]) == to and node.output[0] not in outputs:
            alias[node.output[0]] = node.input[0]
            continue
        kept.append(node)
    return kept
