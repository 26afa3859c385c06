"""Sibling projections fused into one MatMul, the load-time rewrite: the MatMuls that read the same input with
constant weights (an attention's Q, K and V projections; the translator encoder's cross-attention keys and values
of every decoder layer) become one MatMul of their weights side by side, then a `Split` of its output, as in
CTranslate2 (one QKV GEMM, one K/V GEMM for all cross-attention layers) and onnxruntime-genai (packed QKV). On a
step of a few rows each MatMul's hand-off to the thread pool, not its arithmetic, is most of its time: one call for
three projections pays it once.

Invariant: the outputs are the same bit for bit (tests/unit/engines/test_projection_fusion.py), only the number of
kernel calls changes; so only like fuse with like (float MatMuls with float MatMuls, MatMulNBits with MatMulNBits of
the same K, bits, block size and accuracy level and without zero points), and MatMulNBits of which only some add a
bias are left as they are.

Design notes: docs/architecture.md, service/engines/projection_fusion.py.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from service.engines.onnx_graph import (MATMUL_NBITS, MICROSOFT_DOMAIN, NBITS_A, NBITS_B, NBITS_BIAS, NBITS_G_IDX,
                                        NBITS_SCALES, NBITS_ZERO_POINTS, ModelProto, NodeProto, TensorProto,
                                        attribute, default_opset, drop_unread_initializers, float_constants, from_array, make_node,
                                        to_array, to_float32)

__all__ = ["fuse_projections", "fused_projection_count"]

NBITS_SAME = ("K", "bits", "block_size", "accuracy_level")  # attributes the members of a fused group share
SPLIT_INPUT_OPSET = 13  # from this opset on, Split takes the sizes of its parts as an input, not an attribute
FUSED_SUFFIX = "__fused_projection"


def fused_projection_count(model: ModelProto) -> int:
    """How many fused projections (`fuse_projections`) the graph holds."""
    return sum(node.name.endswith(FUSED_SUFFIX) for node in model.graph.node if node.op_type != "Split")


def fuse_projections(model: ModelProto) -> int:
    """In place: each group of two or more MatMuls (or MatMulNBits) reading the same input with constant weights
    becomes one of the concatenated weights followed by a Split on the last axis, and when every member's output
    goes only to an Add of a constant bias, one Add of the concatenated biases (a MatMulNBits' bias input) before
    the Split; returns how many groups were fused."""
    graph = model.graph
    if default_opset(model) < SPLIT_INPUT_OPSET:
        return 0
    constants = float_constants(model)
    initializers = {t.name: t for t in graph.initializer}
    readers: dict[str, list[int]] = defaultdict(list)
    for index, node in enumerate(graph.node):
        for name in node.input:
            readers[name].append(index)
    outputs = {o.name for o in graph.output}
    groups: dict[tuple, list[int]] = defaultdict(list)
    for index, node in enumerate(graph.node):
        key = _group_key(node, constants, initializers)
        if key is not None:
            groups[key].append(index)
    replacements: dict[int, list[NodeProto]] = {}
    removed: set[int] = set()
    for members in groups.values():
        if len(members) < 2:
            continue
        nodes = [graph.node[i] for i in members]
        nbits = nodes[0].op_type == MATMUL_NBITS
        # members that already take a bias (MatMulNBits' input) keep whatever Adds follow them, after the Split
        adds = ([] if nbits and _has_bias_input(nodes[0])
                else [_bias_add(graph, readers, outputs, constants, node) for node in nodes])
        absorbed = bool(adds) and all(adds)
        if nbits and any(adds) and not absorbed:
            # ONNX Runtime folds a constant bias Add into the MatMulNBits before it (its bias input), which adds it
            # within the kernel: fusing only some of the members would change their rounding
            continue
        results = [graph.node[a[0]].output[0] for a in adds] if absorbed else [n.output[0] for n in nodes]
        biases = [a[1] for a in adds] if absorbed else None
        fused = (_fuse_nbits(nodes, results, biases, constants, initializers, graph) if nbits
                 else _fuse_float(nodes, results, biases, constants, graph))
        replacements[members[0]] = fused
        removed.update(members)
        if absorbed:
            removed.update(a[0] for a in adds)
    if not replacements:
        return 0
    kept = []
    for index, node in enumerate(graph.node):
        kept.extend(replacements.get(index, ()))
        if index not in removed:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    drop_unread_initializers(model)
    return len(replacements)


def _bias_add(graph, readers: dict[str, list[int]], outputs: set[str], constants: dict[str, TensorProto],
              node: NodeProto) -> tuple[int, np.ndarray] | None:
    """(index, bias) of the Add of a constant 1-D bias that alone reads `node`'s output, or None."""
    output = node.output[0]
    if output in outputs or len(readers[output]) != 1:
        return None
    index = readers[output][0]
    add = graph.node[index]
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
        return None
    other = add.input[1] if add.input[0] == output else add.input[0]
    bias = constants.get(other)
    if bias is None or len(bias.dims) != 1 or other == output:
        return None
    return index, to_float32(bias)


def _has_bias_input(node: NodeProto) -> bool:
    return len(node.input) > NBITS_BIAS and bool(node.input[NBITS_BIAS])


def _group_key(node: NodeProto, constants: dict[str, TensorProto], initializers: dict[str, TensorProto]
               ) -> tuple | None:
    """What a MatMul must share with the others of its group (its input and kind), or None if it cannot fuse."""
    if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and len(node.input) == 2:
        weight = constants.get(node.input[1])
        if weight is None or len(weight.dims) != 2:
            return None
        return ("MatMul", node.input[0], weight.dims[0])
    if node.op_type == MATMUL_NBITS and node.domain == MICROSOFT_DOMAIN:
        inputs = list(node.input) + [""] * (NBITS_BIAS + 1 - len(node.input))
        if inputs[NBITS_G_IDX] or inputs[NBITS_ZERO_POINTS] or inputs[NBITS_B] not in initializers:
            return None
        if inputs[NBITS_SCALES] not in constants or (inputs[NBITS_BIAS] and inputs[NBITS_BIAS] not in constants):
            return None
        shared = tuple(attribute(node, name, -1) for name in NBITS_SAME)
        return (MATMUL_NBITS, inputs[NBITS_A], bool(inputs[NBITS_BIAS]), *shared)
    return None


def _split(name: str, fused_output: str, results: list[str], widths: list[int], graph) -> NodeProto:
    """The Split of the fused output back into the members' results, under their names."""
    sizes = f"{name}/split"
    graph.initializer.append(from_array(np.array(widths, np.int64), sizes))
    return make_node("Split", [fused_output, sizes], results, f"{name}/Split", axis=-1)


def _fuse_float(nodes: list[NodeProto], results: list[str], biases: list[np.ndarray] | None,
                constants: dict[str, TensorProto], graph) -> list[NodeProto]:
    weights = [to_float32(constants[n.input[1]]) for n in nodes]
    name = nodes[0].name + FUSED_SUFFIX
    graph.initializer.append(from_array(np.concatenate(weights, axis=1), f"{name}/weight"))
    fused = [make_node("MatMul", [nodes[0].input[0], f"{name}/weight"], [f"{name}/output"], name)]
    if biases is not None:
        graph.initializer.append(from_array(np.concatenate(biases), f"{name}/bias"))
        fused.append(make_node("Add", [f"{name}/output", f"{name}/bias"], [f"{name}/biased"], f"{name}/Add"))
    return [*fused, _split(name, fused[-1].output[0], results, [w.shape[1] for w in weights], graph)]


def _fuse_nbits(nodes: list[NodeProto], results: list[str], biases: list[np.ndarray] | None,
                constants: dict[str, TensorProto], initializers: dict[str, TensorProto], graph) -> list[NodeProto]:
    """MatMulNBits' weights are stored per output column (N, blocks, bytes), its scales per column and block: the
    fused weight stacks the members' columns; the biases (their inputs, or the Adds after them) go to its bias
    input."""
    widths = [attribute(n, "N") for n in nodes]
    packed = np.concatenate([to_array(initializers[n.input[NBITS_B]]) for n in nodes], axis=0)
    blocks = packed.shape[1]
    scales = np.concatenate([to_float32(constants[n.input[NBITS_SCALES]]).reshape(width, blocks)
                             for n, width in zip(nodes, widths)], axis=0)
    name = nodes[0].name + FUSED_SUFFIX
    graph.initializer.extend([from_array(packed, f"{name}/weight"), from_array(scales, f"{name}/scales")])
    inputs = [nodes[0].input[NBITS_A], f"{name}/weight", f"{name}/scales"]
    if _has_bias_input(nodes[0]):
        biases = [to_float32(constants[n.input[NBITS_BIAS]]) for n in nodes]
    if biases is not None:
        graph.initializer.append(from_array(np.concatenate(biases), f"{name}/bias"))
        inputs += ["", "", f"{name}/bias"]
    shared = {key: attribute(nodes[0], key) for key in NBITS_SAME}
    matmul = make_node(MATMUL_NBITS, inputs, [f"{name}/output"], name, MICROSOFT_DOMAIN, N=sum(widths), **shared)
    return [matmul, _split(name, f"{name}/output", results, widths, graph)]
