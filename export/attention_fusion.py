"""Rewrite the exported, written-out attention into ONNX Runtime's `com.microsoft.MultiHeadAttention` contrib op.

`models.layers.MultiHeadAttention` exports as plain ops: split heads (Reshape + Transpose) of the Q/K/V projections,
an optional past concatenated along the sequence axis (its result is the `present` graph output),
`MatMul(q, k^T) * scale`, `Where(~mask, finfo.min, scores)`, `Softmax`, `MatMul(weights, v)`, merge heads
(Transpose + Reshape). `fuse_attention` replaces each such block by one MultiHeadAttention node, following the op's
spec in ONNX Runtime's docs/ContribOperators.md (domain com.microsoft, version 1):

- query: the Q projection (B, S, D); key/value: the K/V projections (B, L, D), or, for cross-attention whose
  keys/values arrive already split into heads, those tensors (B, N, L, Dh);
- past_key/past_value (B, N, P, Dh) -> present_key/present_value (B, N, P+L, Dh): the same tensors, under the
  same names, as the Concat they replace;
- attention_bias (B, 1, S, T): the boolean mask turned additive, `Where(~mask, fill, 0)` with the graph's own
  fill value (finfo.min), broadcast over the query axis when the mask has none (key padding masks). Since
  `score + finfo.min` rounds to finfo.min, rows whose every key is masked still get uniform weights, as in the
  written-out form, and no NaN;
- attributes num_heads (from the head-splitting Reshape) and scale (the graph's own constant).

ONNX Runtime's CPU kernel takes all four combinations the project exports (cached causal self-attention, padded
self-attention, cross-attention over heads-first keys/values, unmasked self-attention). The rewrite works on the
graph alone (no checkpoint), so it applies to fresh exports and shipped graphs alike, whatever their weight
storage (a float16 initializer + Cast feeds a projection exactly like a float32 initializer). Blocks that do not
match the layout are left as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import NodeProto, helper, numpy_helper

CONTRIB_DOMAIN = "com.microsoft"
CONTRIB_OPSET = 1
FUSED_OP = "MultiHeadAttention"

SPLIT_HEADS = [0, 2, 1, 3]  # (B, T, H, Dh) -> (B, H, T, Dh), and back when merging heads
KEYS_TRANSPOSED = [0, 1, 3, 2]  # (B, H, T, Dh) -> (B, H, Dh, T)
SPLIT_HEADS_KEYS_TRANSPOSED = [0, 2, 3, 1]  # (B, T, H, Dh) -> (B, H, Dh, T), the exporter's folded pair
CACHE_AXIS = 2  # past and new keys/values are concatenated along (B, H, T, Dh)'s T
HEADS_INDEX = 2  # num_heads in the split-heads Reshape's target shape (B, T, H, Dh)
MASK_QUERY_AXIS = 2  # the query axis of a (B, 1, T, K) mask; 1 for a key padding mask (B, 1, 1, K)
SOFTMAX_AXES = (-1, 3)


class AttentionFusionError(Exception):
    pass


@dataclass
class _KeyValue:
    """How a key or value operand reaches the fused node."""

    tensor: str  # the projection (B, L, D), or heads-first (B, N, L, Dh) when `heads_first`
    heads_first: bool = False
    past: str = ""  # (B, N, P, Dh) concatenated in front, "" if none
    concat: NodeProto | None = None  # the Concat producing the present tensor, replaced by the fused node


@dataclass
class _Block:
    """One matched attention block."""

    query: str
    key: _KeyValue
    value: _KeyValue
    num_heads: int
    scale: float
    merged: NodeProto  # the Reshape merging the heads: its output (B, S, D) becomes the fused node's
    mask: str  # boolean, True where masked; "" if unmasked
    fill: str  # the Where's fill constant
    nodes: list[NodeProto]  # what the fused node replaces, the Softmax first

    @property
    def output(self) -> str:
        return self.merged.output[0]


class _GraphIndex:
    """Producers, consumers and constants of a graph."""

    def __init__(self, graph: onnx.GraphProto):
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers: dict[str, list[NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.initializers = {t.name: t for t in graph.initializer}
        self.outputs = {o.name for o in graph.output}

    def node(self, name: str, op_type: str) -> NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op_type else None

    def constant(self, name: str) -> np.ndarray | None:
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.node(name, "Constant")
        if node is None or node.attribute[0].name != "value":
            return None
        return numpy_helper.to_array(node.attribute[0].t)

    def shape_entry(self, name: str, index: int) -> int | None:
        """Element `index` of a shape tensor when it is a constant: a constant tensor, or a Concat of pieces."""
        whole = self.constant(name)
        if whole is not None:
            return int(whole.reshape(-1)[index]) if whole.size > index else None
        concat = self.node(name, "Concat")
        if concat is None or index >= len(concat.input):
            return None
        piece = self.constant(concat.input[index])
        return int(piece.reshape(-1)[0]) if piece is not None and piece.size == 1 else None


def _attribute(node: NodeProto, name: str, default):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _perm(node: NodeProto) -> list[int]:
    return list(_attribute(node, "perm", []))


def _split_heads(index: _GraphIndex, name: str, perm: list[int]) -> tuple[str, int] | None:
    """`Transpose(perm)(Reshape(projection, (B, T, H, Dh)))` -> (projection, H)."""
    transpose = index.node(name, "Transpose")
    if transpose is None or _perm(transpose) != perm:
        return None
    reshape = index.node(transpose.input[0], "Reshape")
    if reshape is None:
        return None
    heads = index.shape_entry(reshape.input[1], HEADS_INDEX)
    return (reshape.input[0], heads) if heads else None


def _heads_first(index: _GraphIndex, name: str, heads: int) -> _KeyValue | None:
    """A (B, H, L, Dh) key/value operand: split heads of a projection, optionally after a past; else taken as is."""
    split = _split_heads(index, name, SPLIT_HEADS)
    if split is not None:
        return _KeyValue(split[0]) if split[1] == heads else None
    concat = index.node(name, "Concat")
    if concat is not None and len(concat.input) == 2 and _attribute(concat, "axis", None) in (CACHE_AXIS, -2):
        split = _split_heads(index, concat.input[1], SPLIT_HEADS)
        if split is None or split[1] != heads:
            return None
        return _KeyValue(split[0], past=concat.input[0], concat=concat)
    return _KeyValue(name, heads_first=True)


def _only_reader(index: _GraphIndex, name: str, op_type: str) -> NodeProto | None:
    """The single node of type `op_type` reading tensor `name`, when nothing else reads it."""
    readers = index.consumers.get(name, [])
    if len(readers) != 1 or readers[0].op_type != op_type or name in index.outputs:
        return None
    return readers[0]


def _is_lowest(fill: np.ndarray | None) -> bool:
    """Whether a mask fill is the lowest float of its type: then adding it (the op's bias) equals replacing the
    score by it, since `score + lowest` rounds to `lowest`."""
    return fill is not None and fill.size == 1 and fill.dtype.kind == "f" and fill.item() == np.finfo(fill.dtype).min


def _key(index: _GraphIndex, transposed: str, heads: int) -> _KeyValue | None:
    """The key operand behind the (B, H, Dh, L) right-hand side of the score MatMul."""
    folded = _split_heads(index, transposed, SPLIT_HEADS_KEYS_TRANSPOSED)
    if folded is not None:
        return _KeyValue(folded[0]) if folded[1] == heads else None
    transpose = index.node(transposed, "Transpose")
    if transpose is None or _perm(transpose) != KEYS_TRANSPOSED:
        return None
    return _heads_first(index, transpose.input[0], heads)


def _match(index: _GraphIndex, softmax: NodeProto) -> _Block | None:
    """The attention block around `softmax`, or None when it is not the project's layout.

    Every tensor between the score MatMul and the head-merging Reshape must be read inside the block alone; the
    Reshape's output and the presents are produced again, under their names, by the fused node."""
    if _attribute(softmax, "axis", -1) not in SOFTMAX_AXES:
        return None
    scores, mask, fill, masking = softmax.input[0], "", "", []
    where = index.node(scores, "Where")
    if where is not None:
        mask, fill, scores = where.input
        constant = index.constant(fill)
        if not _is_lowest(constant) or _only_reader(index, where.output[0], "Softmax") is None:
            return None
        masking = [where]
    scaled = index.node(scores, "Mul")
    if scaled is None or _only_reader(index, scores, "Where" if where else "Softmax") is None:
        return None
    scale_name = next((name for name in scaled.input if index.constant(name) is not None), "")
    product = index.node(next((name for name in scaled.input if name != scale_name), ""), "MatMul")
    if not scale_name or index.constant(scale_name).size != 1 or product is None:
        return None
    query = _split_heads(index, product.input[0], SPLIT_HEADS)
    if query is None or _only_reader(index, product.output[0], "Mul") is None:
        return None
    heads = query[1]
    key = _key(index, product.input[1], heads)
    context = _only_reader(index, softmax.output[0], "MatMul")
    if key is None or context is None or context.input[0] != softmax.output[0]:
        return None
    value = _heads_first(index, context.input[1], heads)
    merge = _only_reader(index, context.output[0], "Transpose")
    if value is None or merge is None or _perm(merge) != SPLIT_HEADS:
        return None
    reshape = _only_reader(index, merge.output[0], "Reshape")
    if reshape is None or key.heads_first != value.heads_first or bool(key.past) != bool(value.past):
        return None
    scale = float(index.constant(scale_name).reshape(()))
    presents = [kv.concat for kv in (key, value) if kv.concat is not None]
    nodes = [softmax, *masking, scaled, product, context, merge, reshape, *presents]
    return _Block(query[0], key, value, heads, scale, reshape, mask, fill, nodes)


class _Fuser:
    """Matches every block of a graph, then rebuilds the node list with the fused nodes in place."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.graph = model.graph
        self.index = _GraphIndex(self.graph)
        inferred = onnx.shape_inference.infer_shapes(model).graph
        self.shapes = {v.name: v.type.tensor_type.shape for v in inferred.value_info}
        self.biases: dict[tuple[str, bytes], str] = {}  # (mask, fill value) -> additive bias
        self.taken = set(self.index.producer) | set(self.index.initializers) | {i.name for i in self.graph.input}

    def _unique(self, stem: str) -> str:
        name, counter = stem, 0
        while name in self.taken:
            counter += 1
            name = f"{stem}_{counter}"
        self.taken.add(name)
        return name

    def _constant(self, stem: str, value: np.ndarray) -> str:
        name = self._unique(stem)
        self.graph.initializer.append(numpy_helper.from_array(value, name))
        return name

    def _needs_query_axis(self, mask: str) -> bool:
        """A mask without a query axis of its own ((B, 1, 1, K), or unknown) is broadcast to (B, 1, S, K)."""
        shape = self.shapes.get(mask)
        if shape is None or len(shape.dim) <= MASK_QUERY_AXIS:
            return True
        dim = shape.dim[MASK_QUERY_AXIS]
        return not dim.dim_param and dim.dim_value in (0, 1)

    def _bias(self, block: _Block, new_nodes: list[NodeProto]) -> str:
        """The additive attention_bias (B, 1, S, T) of a block's mask; new nodes go to `new_nodes`."""
        fill = self.index.constant(block.fill)
        key = (self._mask_source(block.mask), fill.tobytes())
        bias = self.biases.get(key)
        if bias is None:
            zero = self._constant(f"{block.mask}__allowed", np.zeros((), fill.dtype))
            bias = self._unique(f"{block.mask}__attention_bias")
            new_nodes.append(helper.make_node("Where", [block.mask, block.fill, zero], [bias], name=bias))
            self.biases[key] = bias
        if not self._needs_query_axis(block.mask):
            return bias
        query_length = self._unique(f"{block.output}__query_length")
        target = self._unique(f"{block.output}__bias_shape")
        expanded = self._unique(f"{block.output}__attention_bias")
        leading = self._constant(f"{block.output}__bias_shape_leading", np.ones(MASK_QUERY_AXIS, np.int64))
        trailing = self._constant(f"{block.output}__bias_shape_trailing", np.ones(1, np.int64))
        new_nodes += [  # (B, 1, 1, T) -> (B, 1, S, T), S read off the query (B, S, D)
            helper.make_node("Shape", [block.query], [query_length], name=query_length, start=1, end=2),
            helper.make_node("Concat", [leading, query_length, trailing], [target], name=target, axis=0),
            helper.make_node("Expand", [bias, target], [expanded], name=expanded),
        ]
        return expanded

    def _mask_source(self, mask: str) -> str:
        """Casts to bool of one tensor are the same mask; key the shared bias by what they cast."""
        cast = self.index.node(mask, "Cast")
        return cast.input[0] if cast is not None and _attribute(cast, "to", None) == onnx.TensorProto.BOOL else mask

    def _fused_node(self, block: _Block, bias: str) -> NodeProto:
        past = [block.key.past, block.value.past] if block.key.past else []
        inputs = [block.query, block.key.tensor, block.value.tensor, "", "", bias, *past]
        while inputs[-1] == "":
            inputs.pop()
        outputs = [block.output]
        if block.key.concat is not None:
            outputs += [block.key.concat.output[0], block.value.concat.output[0]]
        name = self._unique(f"{block.nodes[0].name.rpartition('/')[0]}/{FUSED_OP}")  # /model/blocks.0/attn/...
        return helper.make_node(FUSED_OP, inputs, outputs, name=name, domain=CONTRIB_DOMAIN,
                                num_heads=block.num_heads, scale=block.scale)

    def run(self) -> int:
        blocks = [b for b in (_match(self.index, n) for n in self.graph.node if n.op_type == "Softmax") if b]
        if not blocks:
            return 0
        replaced = {id(node) for block in blocks for node in block.nodes}
        anchors = {id(block.merged): block for block in blocks}  # every input of the fused node is defined by then
        rebuilt: list[NodeProto] = []
        for node in self.graph.node:
            block = anchors.get(id(node))
            if block is not None:
                bias = self._bias(block, rebuilt) if block.mask else ""
                rebuilt.append(self._fused_node(block, bias))
            elif id(node) not in replaced:
                rebuilt.append(node)
        del self.graph.node[:]
        self.graph.node.extend(_live(rebuilt, {o.name for o in self.graph.output}))
        used = {name for node in self.graph.node for name in node.input}
        used |= {v.name for v in (*self.graph.input, *self.graph.output)}
        for initializer in [t for t in self.graph.initializer if t.name not in used]:
            self.graph.initializer.remove(initializer)
        if all(o.domain != CONTRIB_DOMAIN for o in self.model.opset_import):
            self.model.opset_import.append(helper.make_opsetid(CONTRIB_DOMAIN, CONTRIB_OPSET))
        return len(blocks)


def _live(nodes: list[NodeProto], outputs: set[str]) -> list[NodeProto]:
    """The nodes (in topological order) that the graph outputs depend on."""
    needed, kept = set(outputs), []
    for node in reversed(nodes):
        if any(name in needed for name in node.output):
            kept.append(node)
            needed.update(node.input)
    return kept[::-1]


def _signature(graph: onnx.GraphProto) -> list[tuple[str, str, int, int]]:
    """(input/output, name, element type, rank) of every graph input and output."""
    return [(kind, v.name, v.type.tensor_type.elem_type, len(v.type.tensor_type.shape.dim))
            for kind, values in (("input", graph.input), ("output", graph.output)) for v in values]


def fuse_attention(path: Path) -> int:
    """Rewrite the ONNX file at `path` in place: every attention block of the project's layout becomes one
    com.microsoft MultiHeadAttention node; returns how many were fused. Runs onnx.checker afterwards."""
    model = onnx.load(str(path))
    before = _signature(model.graph)
    fused = _Fuser(model).run()
    if _signature(model.graph) != before:
        raise AttentionFusionError(f"fusing attention changed the inputs/outputs of {path}")
    if fused:
        onnx.save(model, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    return fused
