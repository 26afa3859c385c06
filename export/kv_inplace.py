"""Rewrite a decoder graph so that its one-token step writes the new keys/values into the past buffers in place.

The exported decoders (`service.engines.onnx_schema`: GPT decoder.onnx, translation decoder.onnx) make each layer's present
as `Concat(past, new, axis=2)`, a copy of the whole past every step. `make_inplace_kv` turns that into
`ScatterND(past, indices, new)`: the past is a fixed-capacity buffer (B, H, C, Dh), the new token's keys/values go
to row b's slot `cache_slot[b]` (a new int64 input (B,): each row's tokens start at slot 0, as in
`service.engines.kv_cache`, which keeps a row's logits the same in any batch), and attention runs over the whole buffer;
the attention mask then has the buffer's length C and marks the used slots, the new one included. With one query
token the graph's causal mask allows every slot, so masking the unused ones is all it takes.

ONNX Runtime's CPU ScatterND copies its input into its output first unless both are the same buffer; an engine
that binds the past and the present to the same memory (IO binding) gets the write without the copy. Indices are
(B, H, 1, 3): one row of Dh values per (row, head), written contiguously.

Both layouts are handled: the written-out attention (Concat feeding the attention), which
`export.attention_fusion.fuse_attention` then fuses with the buffer as heads-first keys/values; and an already
fused graph (com.microsoft MultiHeadAttention with past_key/past_value), whose node gets the written buffers as
heads-first key/value instead. Only one-token steps are valid on the rewritten graph: a prompt pass keeps the
original graph, so `add_step_graph` writes the rewrite beside it (`onnx_schema.DECODER_STEP_FILE`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import NodeProto, TensorProto, helper, numpy_helper

from service.engines import onnx_schema as schema
CACHE_AXIS = 2  # (B, H, T, Dh)'s T
HEADS_AXIS = 1
FUSED_OP, CONTRIB_DOMAIN = "MultiHeadAttention", "com.microsoft"
FUSED_PAST_INPUTS = (6, 7)  # past_key, past_value of com.microsoft.MultiHeadAttention
FUSED_PRESENT_OUTPUTS = (1, 2)  # present_key, present_value
PREFIX = "kv_inplace"


class KVInplaceError(ValueError):
    pass


def _presents(graph: onnx.GraphProto) -> dict[str, tuple[int, str]]:
    """present output name -> (layer, matching past input name)."""
    inputs = {i.name for i in graph.input}
    found = {}
    for layer in range(len(graph.output)):
        for past, present in zip(schema.past_names(layer), schema.present_names(layer)):
            if past in inputs and present in {o.name for o in graph.output}:
                found[present] = (layer, past)
    return found


def _dim(value: onnx.ValueInfoProto, axis: int) -> onnx.TensorShapeProto.Dimension:
    return value.type.tensor_type.shape.dim[axis]


class _Rewriter:
    def __init__(self, model: onnx.ModelProto):
        self.graph = model.graph
        self.presents = _presents(self.graph)
        if not self.presents:
            raise KVInplaceError("the graph has no past_key_values.* -> present.* pair")
        self.inputs = {i.name: i for i in self.graph.input}
        first_past = next(past for _, past in self.presents.values())
        self.heads = _dim(self.inputs[first_past], HEADS_AXIS).dim_value
        self.head_dim = _dim(self.inputs[first_past], 3).dim_value
        if not self.heads or not self.head_dim:
            raise KVInplaceError(f"{first_past} needs static heads and head_dim")
        self.first_past = first_past
        self.nodes: list[NodeProto] = []
        self.indices_name = ""

    def _const(self, name: str, value: np.ndarray) -> str:
        self.graph.initializer.append(numpy_helper.from_array(value, f"{PREFIX}/{name}"))
        return f"{PREFIX}/{name}"

    def _node(self, op: str, inputs: list[str], name: str, **attributes) -> str:
        output = f"{PREFIX}/{name}"
        self.nodes.append(helper.make_node(op, inputs, [output], name=output, **attributes))
        return output

    def indices(self) -> str:
        """(B, H, 1, 3) int64: [row, head, cache_slot[row]] for every row and head."""
        rows_heads = self._node("Shape", [self.first_past], "rows_heads", start=0, end=2)
        target = self._node("Concat", [rows_heads, self._const("ones2", np.ones(2, np.int64))], "target", axis=0)
        rows = self._node("Shape", [self.first_past], "rows", start=0, end=1)
        rows_scalar = self._node("Squeeze", [rows, self._const("axis0", np.zeros(1, np.int64))], "rows_scalar")
        row_range = self._node("Range", [self._const("zero", np.array(0, np.int64)), rows_scalar,
                                         self._const("one", np.array(1, np.int64))], "row_range")
        column = self._const("column", np.array([-1, 1, 1, 1], np.int64))
        row_index = self._node("Reshape", [row_range, column], "row_index")
        head_index = self._const("head_index", np.arange(self.heads, dtype=np.int64).reshape(1, -1, 1, 1))
        slot = self._node("Reshape", [schema.CACHE_SLOT, column], "slot")  # (B,) -> (B, 1, 1, 1)
        parts = [self._node("Expand", [part, target], f"{label}_grid")
                 for label, part in (("row", row_index), ("head", head_index), ("slot", slot))]
        return self._node("Concat", parts, "indices", axis=3)

    def split_heads(self, projection: str, name: str) -> str:
        """(B, 1, D) -> (B, H, 1, Dh) by one Reshape: with a single token per row, (B, 1, H, Dh) transposed
        heads-first has the same memory order as (B, H, 1, Dh), so no Transpose (a copy per layer and operand) is
        needed; ONNX Runtime's Reshape is a view."""
        shape = self._const(f"{name}_shape", np.array([0, self.heads, 1, self.head_dim], np.int64))
        return self._node("Reshape", [projection, shape], name)

    def run(self) -> int:
        original = list(self.graph.node)
        indices = self.indices_name = self.indices()
        head = list(self.nodes)
        self.nodes = []
        rewritten = 0
        rebuilt: list[NodeProto] = []
        for node in original:
            if node.op_type == "Concat" and node.output[0] in self.presents:
                _, past = self.presents[node.output[0]]
                if list(node.input[:1]) != [past] or len(node.input) != 2:
                    raise KVInplaceError(f"{node.output[0]} is not Concat({past}, new)")
                rebuilt.append(helper.make_node("ScatterND", [past, indices, node.input[1]], [node.output[0]],
                                                name=f"{PREFIX}/{node.output[0]}"))
                rewritten += 1
            elif node.op_type == FUSED_OP and node.domain == CONTRIB_DOMAIN and len(node.input) > 7 \
                    and node.input[FUSED_PAST_INPUTS[0]]:
                rebuilt += self._fused(node)
                rewritten += 2
            else:
                rebuilt.append(node)
        if rewritten != len(self.presents):
            raise KVInplaceError(f"rewrote {rewritten} of {len(self.presents)} presents")
        del self.graph.node[:]
        self.graph.node.extend(head + rebuilt)
        self._retype()
        return rewritten // 2

    def _fused(self, node: NodeProto) -> list[NodeProto]:
        """MultiHeadAttention(q, k, v, ..., past_k, past_v) -> (out, present_k, present_v) becomes two scatters of
        the split-heads k/v into the pasts and MultiHeadAttention(q, present_k, present_v, ...) -> out."""
        self.nodes = []
        inputs = list(node.input)
        outputs = list(node.output)
        presents = []
        for operand, past_at, present_at in zip((1, 2), FUSED_PAST_INPUTS, FUSED_PRESENT_OUTPUTS):
            heads = self.split_heads(inputs[operand], f"{outputs[present_at]}/new")
            self.nodes.append(helper.make_node("ScatterND", [inputs[past_at], self.indices_name, heads],
                                               [outputs[present_at]], name=f"{PREFIX}/{outputs[present_at]}"))
            presents.append(outputs[present_at])
        inputs[1:3] = presents
        del inputs[FUSED_PAST_INPUTS[0]:]
        while inputs and inputs[-1] == "":
            inputs.pop()
        fused = helper.make_node(FUSED_OP, inputs, outputs[:1], name=node.name, domain=node.domain)
        fused.attribute.extend(node.attribute)
        return [*self.nodes, fused]

    def _retype(self) -> None:
        """cache_slot (B,) in; the attention mask and the presents take the pasts' length (the capacity)."""
        past_dim = _dim(self.inputs[self.first_past], CACHE_AXIS)
        rows = _dim(self.inputs[self.first_past], 0)
        slot = helper.make_tensor_value_info(schema.CACHE_SLOT, TensorProto.INT64, [None])
        _dim(slot, 0).CopyFrom(rows)
        self.graph.input.append(slot)
        _dim(self.inputs[schema.ATTENTION_MASK], 1).CopyFrom(past_dim)
        for output in self.graph.output:
            if output.name in self.presents:
                _dim(output, CACHE_AXIS).CopyFrom(past_dim)
        kept = {o.name for o in self.graph.output} | {i.name for i in self.graph.input}
        for value in [v for v in self.graph.value_info if v.name in self.presents and v.name not in kept]:
            self.graph.value_info.remove(value)


def make_inplace_kv(path: Path) -> int:
    """Rewrite the decoder graph at `path` in place into its in-place step form; returns how many layers were
    rewritten. Runs onnx.checker afterwards. Raises KVInplaceError if the graph lacks the past/present layout."""
    model = onnx.load(str(path))
    layers = _Rewriter(model).run()
    onnx.save(model, str(path))
    onnx.checker.check_model(str(path), full_check=True)
    return layers


def add_step_graph(folder: Path, config: dict) -> int:
    """Give a model version folder (gpt or translation) its in-place step graph: a rewritten copy of its decoder
    as `onnx_schema.DECODER_STEP_FILE`, recorded in `config["files"]["decoder_step"]` (the caller writes
    config.json); returns the layers rewritten. The GPT keeps its original decoder: the prompt pass runs it. The
    translator's decoder is only ever fed one token per row (the start token, then steps), so the step graph
    replaces it (no second copy of the decoder's weights in the version)."""
    if "decoder" not in config["files"] or config["kind"] == "vit":
        raise KVInplaceError(f"a {config['kind']} model has no decoder to step in place")
    step = folder / schema.DECODER_STEP_FILE
    shutil.copyfile(folder / config["files"]["decoder"], step)
    layers = make_inplace_kv(step)
    files = {**config["files"], "decoder_step": schema.DECODER_STEP_FILE}  # a new dict: never the source's
    if config["kind"] == "translation":
        (folder / files.pop("decoder")).unlink()
    config["files"] = files
    return layers
