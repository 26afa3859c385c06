"""Thin torch modules that expose the models' own entry points with flat tensor inputs/outputs for ONNX export.

They wrap `GPT.forward`, `EncoderDecoderTransformer.encode` / `cross_attention_kv` / `decode_step` and
`ViT.forward`; no layer is re-implemented here. Input/output order is `service.engines.onnx_schema`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from models.gpt import GPT
from models.transformer import EncoderDecoderTransformer
from models.vit import ViT


def _pairs(flat: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


def _flatten(pairs) -> tuple[torch.Tensor, ...]:
    return tuple(t for pair in pairs for t in pair)


class GPTDecoderGraph(nn.Module):
    """(input_ids, position_ids, attention_mask, *past) -> (logits, *present)."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attention_mask, *past):
        logits, present = self.model(input_ids, position_ids, attention_mask.bool(), _pairs(past))
        return (logits, *_flatten(present))


class EncoderGraph(nn.Module):
    """(input_ids, attention_mask) -> per decoder layer cross-attention key, value."""

    def __init__(self, model: EncoderDecoderTransformer):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        memory = self.model.encode(input_ids, attention_mask.bool())
        return _flatten(self.model.cross_attention_kv(memory))


class DecoderStepGraph(nn.Module):
    """(input_ids, position_ids, attention_mask, encoder_attention_mask, encoder_row, *past, *cross)
    -> (logits, *present). Row r attends to encoded source encoder_row[r]."""

    def __init__(self, model: EncoderDecoderTransformer):
        super().__init__()
        self.model = model
        self.n_layers = model.config.n_decoder_layers

    def forward(self, input_ids, position_ids, attention_mask, encoder_attention_mask, encoder_row, *caches):
        past, cross = _pairs(caches[: 2 * self.n_layers]), _pairs(caches[2 * self.n_layers :])
        cross_rows = [(k.index_select(0, encoder_row), v.index_select(0, encoder_row)) for k, v in cross]
        source_mask = encoder_attention_mask.bool().index_select(0, encoder_row)
        logits, present = self.model.decode_step(input_ids, position_ids, attention_mask.bool(), cross_rows,
                                                 source_mask, past)
        return (logits, *_flatten(present))


class ViTGraph(nn.Module):
    """(pixel_values) -> logits."""

    def __init__(self, model: ViT):
        super().__init__()
        self.model = model

    def forward(self, pixel_values):
        return self.model(pixel_values)
