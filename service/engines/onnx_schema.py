"""ONNX graph interfaces: input/output names and dynamic axes, defined once for the exporter and the runtime.

Follows the convention of Optimum and onnxruntime-genai: `past_key_values.{i}.key` in, `present.{i}.key` out.
Every graph takes int64 ids/positions and int64 masks (1 = real token) and float32 tensors; cache tensors are
laid out (batch, heads, sequence, head_dim). Graphs per model kind: gpt `decoder.onnx`; translation `encoder.onnx`
(-> `cross_attention.{i}.key/value`, once per source) and `decoder.onnx` (`encoder_row[r]`: the encoded source row
r decodes, shared by its beams by index); vit `model.onnx`; gpt and translation may add `decoder_step.onnx`
(`export.kv_inplace`: one-token steps over fixed-capacity caches, the new slot at `cache_slot`).

Design notes (each graph's inputs and outputs): docs/architecture.md, service/engines/onnx_schema.py.
"""

from __future__ import annotations

from dataclasses import dataclass

# file names inside a model version folder
GPT_DECODER_FILE = "decoder.onnx"
ENCODER_FILE = "encoder.onnx"
DECODER_FILE = "decoder.onnx"
DECODER_STEP_FILE = "decoder_step.onnx"  # optional: the in-place one-token step graph (export.kv_inplace)
VIT_FILE = "model.onnx"

INPUT_IDS = "input_ids"
POSITION_IDS = "position_ids"
ATTENTION_MASK = "attention_mask"
ENCODER_ATTENTION_MASK = "encoder_attention_mask"
ENCODER_ROW = "encoder_row"
CACHE_SLOT = "cache_slot"
LOGITS = "logits"
# the decoder graphs' row candidates, added when a translation engine loads them (`service.engines.row_candidates`)
CANDIDATES_K = "candidates_k"
TOP_LOGPROBS = "top_logprobs"
TOP_IDS = "top_ids"
PIXEL_VALUES = "pixel_values"

# The token id fed where the attention mask is 0 (a right-padded prompt's tail, a batch's dead rows): such slots
# never reach a real row's output, so any id of the vocabulary serves, and 0 is in every one. A config that names
# its own (`special_tokens.pad_id`, the translator's, which it was trained with) is read instead.
PAD_ID = 0

BATCH, SEQUENCE, PAST, TOTAL = "batch", "sequence", "past_sequence", "total_sequence"
SOURCE, SOURCES = "source", "sources"


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"


def present_names(layer: int) -> tuple[str, str]:
    return f"present.{layer}.key", f"present.{layer}.value"


def cross_names(layer: int) -> tuple[str, str]:
    return f"cross_attention.{layer}.key", f"cross_attention.{layer}.value"


@dataclass(frozen=True)
class GraphSpec:
    """Names in order, and the symbolic (dynamic) axes of each, as torch.onnx.export wants them."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    dynamic_axes: dict[str, dict[int, str]]


def _flat(names_per_layer: list[tuple[str, str]]) -> tuple[str, ...]:
    return tuple(name for pair in names_per_layer for name in pair)


def gpt_decoder_spec(n_layers: int) -> GraphSpec:
    past = _flat([past_names(i) for i in range(n_layers)])
    present = _flat([present_names(i) for i in range(n_layers)])
    axes = {INPUT_IDS: {0: BATCH, 1: SEQUENCE}, POSITION_IDS: {0: BATCH, 1: SEQUENCE},
            ATTENTION_MASK: {0: BATCH, 1: TOTAL}, LOGITS: {0: BATCH, 1: SEQUENCE}}
    axes.update({name: {0: BATCH, 2: PAST} for name in past})
    axes.update({name: {0: BATCH, 2: TOTAL} for name in present})
    return GraphSpec((INPUT_IDS, POSITION_IDS, ATTENTION_MASK) + past, (LOGITS,) + present, axes)


def encoder_spec(n_decoder_layers: int) -> GraphSpec:
    cross = _flat([cross_names(i) for i in range(n_decoder_layers)])
    axes = {INPUT_IDS: {0: SOURCES, 1: SOURCE}, ATTENTION_MASK: {0: SOURCES, 1: SOURCE}}
    axes.update({name: {0: SOURCES, 2: SOURCE} for name in cross})
    return GraphSpec((INPUT_IDS, ATTENTION_MASK), cross, axes)


def decoder_spec(n_decoder_layers: int) -> GraphSpec:
    past = _flat([past_names(i) for i in range(n_decoder_layers)])
    cross = _flat([cross_names(i) for i in range(n_decoder_layers)])
    present = _flat([present_names(i) for i in range(n_decoder_layers)])
    axes = {INPUT_IDS: {0: BATCH, 1: SEQUENCE}, POSITION_IDS: {0: BATCH, 1: SEQUENCE},
            ATTENTION_MASK: {0: BATCH, 1: TOTAL}, ENCODER_ATTENTION_MASK: {0: SOURCES, 1: SOURCE},
            ENCODER_ROW: {0: BATCH}, LOGITS: {0: BATCH, 1: SEQUENCE}}
    axes.update({name: {0: BATCH, 2: PAST} for name in past})
    axes.update({name: {0: SOURCES, 2: SOURCE} for name in cross})
    axes.update({name: {0: BATCH, 2: TOTAL} for name in present})
    inputs = (INPUT_IDS, POSITION_IDS, ATTENTION_MASK, ENCODER_ATTENTION_MASK, ENCODER_ROW) + past + cross
    return GraphSpec(inputs, (LOGITS,) + present, axes)


def vit_spec() -> GraphSpec:
    return GraphSpec((PIXEL_VALUES,), (LOGITS,), {PIXEL_VALUES: {0: BATCH}, LOGITS: {0: BATCH}})
