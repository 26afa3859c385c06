"""The in-place step graph's attention as ONNX Runtime's `GroupQueryAttention`: the load-time rewrite of the `gqa`
variants (`service.engines.weights`), after how onnxruntime-genai runs its CPU decoders over a shared KV buffer.

The in-place step graph (`export.kv_inplace`) scatters each row's new keys/values into slot `cache_slot[row]`, then
runs a masked `MultiHeadAttention` over the whole buffer; GroupQueryAttention does both in one kernel and attends
over each row's own `seqlens_k[row] + 1` slots only. Where the projections were fused
(`service.engines.projection_fusion`), `pack_query_key_value` feeds it the fused QKV whole and the Split goes.

Invariant: it relies on the buffers' layout (`service.engines.kv_storage`): every row's tokens sit in slots
[0, cache_slot[row]), so `seqlens_k` = `cache_slot` and the attention mask is not read; rows stay batch-invariant.
Another kernel sums in another order (outputs may differ in the last bits), so the variant is quality-checked at
export like a weights variant (`export.variants`).

Design notes: docs/architecture.md, service/engines/step_attention.py.
"""

from __future__ import annotations

import numpy as np

from service.engines import onnx_schema as schema
from service.engines.onnx_graph import (MICROSOFT_DOMAIN, ModelProto, NodeProto, TensorProto, attribute,
                                        drop_unread_initializers, from_array, make_node)

__all__ = ["GQA", "has_masked_step_attention", "pack_query_key_value", "to_group_query_attention"]

GQA = "gqa"  # the variant suffix (`service.engines.weights`)
GQA_QUERY, GQA_KEY, GQA_VALUE = 0, 1, 2  # GroupQueryAttention's inputs; key and value empty: the query is packed QKV
MASKED_ATTENTION, GROUP_QUERY_ATTENTION, SCATTER = "MultiHeadAttention", "GroupQueryAttention", "ScatterND"
MHA_QUERY, MHA_KEY, MHA_VALUE = 0, 1, 2  # MultiHeadAttention's inputs
SCATTER_DATA, SCATTER_UPDATES = 0, 2  # ScatterND's
PREFIX = "step_attention"
SEQLENS_K, TOTAL_LENGTH = f"{PREFIX}/seqlens_k", f"{PREFIX}/total_sequence_length"
COPIED_ATTRIBUTES = ("num_heads", "scale")  # what GroupQueryAttention takes over from the masked node


def _masked_layers(model: ModelProto) -> list[tuple[NodeProto, NodeProto, NodeProto]]:
    """(MultiHeadAttention, keys' ScatterND, values' ScatterND) of every layer whose attention reads buffers that
    a ScatterND wrote: the in-place step graph's layers."""
    producer = {output: node for node in model.graph.node for output in node.output}
    layers = []
    for node in model.graph.node:
        if node.op_type != MASKED_ATTENTION or node.domain != MICROSOFT_DOMAIN or len(node.input) <= MHA_VALUE:
            continue
        keys, values = producer.get(node.input[MHA_KEY]), producer.get(node.input[MHA_VALUE])
        if keys is not None and values is not None and keys.op_type == values.op_type == SCATTER:
            layers.append((node, keys, values))
    return layers


def has_masked_step_attention(model: ModelProto) -> bool:
    """Whether the graph is an in-place step graph with masked attention that `to_group_query_attention` rewrites."""
    return any(i.name == schema.CACHE_SLOT for i in model.graph.input) and bool(_masked_layers(model))


def _new_tokens(producer: dict[str, NodeProto], scatter: NodeProto) -> str:
    """The (rows, 1, heads x head_dim) keys or values that `scatter` writes, before the graph split their heads
    into the (rows, heads, 1, head_dim) updates: a Reshape, after or without a Transpose (`export.kv_inplace` has
    written both)."""
    node = producer.get(scatter.input[SCATTER_UPDATES])
    if node is not None and node.op_type == "Transpose":
        node = producer.get(node.input[0])
    if node is None or node.op_type != "Reshape":
        raise ValueError(f"unexpected step graph: {scatter.name}'s updates are not the heads of a (rows, 1, width) "
                         "projection (Reshape, or Reshape then Transpose)")
    return node.input[0]


def to_group_query_attention(model: ModelProto) -> int:
    """In place: each layer's ScatterND x 2 + MultiHeadAttention becomes one GroupQueryAttention over the same
    buffers, whose present outputs keep the ScatterNDs' names (so the graph's presents are unchanged); what nothing
    reads any more (the slot indices, the mask's bias) is removed. Returns how many layers were rewritten; raises
    ValueError when the graph is not an in-place step graph."""
    if not has_masked_step_attention(model):
        raise ValueError(f"not an in-place step graph with {MASKED_ATTENTION} over ScatterND-written buffers "
                         f"(`export.kv_inplace`): nothing to rewrite to {GROUP_QUERY_ATTENTION}")
    graph = model.graph
    producer = {output: node for node in graph.node for output in node.output}
    added = [make_node("Cast", [schema.CACHE_SLOT], [SEQLENS_K], f"{PREFIX}/seqlens", to=TensorProto.INT32),
             make_node("ReduceMax", [schema.CACHE_SLOT], [f"{PREFIX}/last_slot"], f"{PREFIX}/last_slot", keepdims=1),
             make_node("Add", [f"{PREFIX}/last_slot", f"{PREFIX}/one"], [f"{PREFIX}/total64"], f"{PREFIX}/total"),
             make_node("Cast", [f"{PREFIX}/total64"], [TOTAL_LENGTH], f"{PREFIX}/total32", to=TensorProto.INT32)]
    graph.initializer.append(from_array(np.ones(1, np.int64), f"{PREFIX}/one"))
    dropped: set[int] = set()
    for attention, keys, values in _masked_layers(model):
        inputs = [attention.input[MHA_QUERY], _new_tokens(producer, keys), _new_tokens(producer, values),
                  keys.input[SCATTER_DATA], values.input[SCATTER_DATA], SEQLENS_K, TOTAL_LENGTH]
        outputs = [attention.output[0], keys.output[0], values.output[0]]
        node = make_node(GROUP_QUERY_ATTENTION, inputs, outputs, f"{attention.name}/{GQA}", MICROSOFT_DOMAIN,
                         kv_num_heads=attribute(attention, "num_heads"))  # as many key/value heads as queries
        for copied in (a for a in attention.attribute if a.name in COPIED_ATTRIBUTES):
            node.attribute.add().CopyFrom(copied)
        added.append(node)
        dropped |= {id(attention), id(keys), id(values)}
    nodes = [node for node in graph.node if id(node) not in dropped] + added
    outputs = {output.name for output in graph.output}
    while True:  # what nothing reads any more (the slot indices, the attention bias) goes
        read = {name for node in nodes for name in node.input} | outputs
        kept = [node for node in nodes if any(output in read for output in node.output)]
        if len(kept) == len(nodes):
            break
        nodes = kept
    read = {name for node in nodes for name in node.input} | outputs
    initializers = [t for t in graph.initializer if t.name in read]
    del graph.node[:]
    graph.node.extend(_topological(nodes, {i.name for i in graph.input} | {t.name for t in initializers}))
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    return len(dropped) // 3


def pack_query_key_value(model: ModelProto) -> int:
    """In place: every GroupQueryAttention whose query, key and value are, in that order, the three parts of one
    Split that nothing else reads (fused projections) takes the Split's input as its packed QKV query instead, and
    the Split goes. Returns how many were packed."""
    graph = model.graph
    producer = {output: node for node in graph.node for output in node.output}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    dropped: set[int] = set()
    for node in graph.node:
        if node.op_type != GROUP_QUERY_ATTENTION or len(node.input) <= GQA_VALUE:
            continue
        split = producer.get(node.input[GQA_QUERY])
        parts = list(node.input[GQA_QUERY : GQA_VALUE + 1])
        if (split is None or split.op_type != "Split" or list(split.output) != parts
                or any(readers[part] != 1 for part in parts) or attribute(split, "axis", 0) != -1):
            continue
        node.input[GQA_QUERY], node.input[GQA_KEY], node.input[GQA_VALUE] = split.input[0], "", ""
        dropped.add(id(split))
    kept = [node for node in graph.node if id(node) not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    if dropped:
        drop_unread_initializers(model)  # the Splits' sizes
    return len(dropped)


def _topological(nodes: list[NodeProto], available: set[str]) -> list[NodeProto]:
    """`nodes` in an order where each comes after the producers of its inputs (ONNX requires it; the new nodes were
    appended at the end)."""
    ordered, pending, known = [], list(nodes), set(available) | {""}
    while pending:
        ready = [node for node in pending if all(name in known for name in node.input)]
        if not ready:
            raise ValueError("the rewritten step graph has a cycle or an input nothing produces")
        for node in ready:
            ordered.append(node)
            known.update(node.output)
        ready_ids = {id(node) for node in ready}
        pending = [node for node in pending if id(node) not in ready_ids]
    return ordered
