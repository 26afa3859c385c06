"""Each row's most likely next tokens, computed inside the decoder graph: the load-time rewrite that adds them.

A beam search keeps the K best continuations of its rows by accumulated log-probability; they lie among each row's
K best tokens (plus the tokens its processors ban there). So instead of handing every logit to numpy (a float64
normaliser over all R x V entries, block maxima, a selection), the decoder graph gets two more nodes after its
logits, ONNX ``LogSoftmax`` then ``TopK`` over the vocabulary, and returns each row's ``k`` best log-probabilities
(float32) and token ids, best first, ties by lower id (ONNX TopK's order). ``k`` is an input: each step asks for
what its searches need (`service.decoding.Search.row_candidates`), 0 when none is a beam search. On 2 AVX2 cores
ONNX Runtime does this for 128 rows x 8,000 tokens in ~1.5 ms, where numpy took ~6 ms (docs/benchmarks.md).

The logits output is unchanged (greedy decoding, sampling and log-probabilities read it as before). After the
``beam_candidates`` decomposition of CTranslate2 and onnxruntime-genai's beam search, whose log-softmax and
per-row top-k run on the device beside the model.
"""

from __future__ import annotations

import numpy as np

from service.engines import onnx_schema as schema
from service.engines.onnx_graph import ModelProto, from_array, make_node
from service.engines.onnx_graph.onnx_graph_pb2 import TensorProto, TensorShapeProto, TypeProto, ValueInfoProto

__all__ = ["add_row_candidates", "has_row_candidates"]

_LOG_PROBS = "row_candidates/log_probs"


def _value_info(name: str, element: int, dims: list[str | int]) -> ValueInfoProto:
    shape = TensorShapeProto(dim=[TensorShapeProto.Dimension(dim_param=d) if isinstance(d, str)
                                  else TensorShapeProto.Dimension(dim_value=d) for d in dims])
    return ValueInfoProto(name=name, type=TypeProto(tensor_type=TypeProto.Tensor(elem_type=element, shape=shape)))


def has_row_candidates(model: ModelProto) -> bool:
    return any(o.name == schema.TOP_IDS for o in model.graph.output)


def add_row_candidates(model: ModelProto) -> None:
    """In place: input `CANDIDATES_K` (int64 (1,), 0 when not fed: an initializer of the same name is its
    default), outputs `TOP_LOGPROBS` (float32) and `TOP_IDS` (int64), both (batch, sequence, k): the k most likely
    tokens of every row and position of the graph's logits."""
    graph = model.graph
    if has_row_candidates(model):
        return
    if not any(o.name == schema.LOGITS for o in graph.output):
        raise ValueError(f"the graph has no {schema.LOGITS!r} output to take candidates from")
    graph.input.append(_value_info(schema.CANDIDATES_K, TensorProto.INT64, [1]))
    graph.initializer.append(from_array(np.zeros(1, np.int64), schema.CANDIDATES_K))
    graph.node.append(make_node("LogSoftmax", [schema.LOGITS], [_LOG_PROBS], "row_candidates/LogSoftmax", axis=-1))
    graph.node.append(make_node("TopK", [_LOG_PROBS, schema.CANDIDATES_K], [schema.TOP_LOGPROBS, schema.TOP_IDS],
                                "row_candidates/TopK", axis=-1, largest=1, sorted=1))
    dims: list[str | int] = [schema.BATCH, schema.SEQUENCE, "candidates"]
    graph.output.append(_value_info(schema.TOP_LOGPROBS, TensorProto.FLOAT, dims))
    graph.output.append(_value_info(schema.TOP_IDS, TensorProto.INT64, dims))
