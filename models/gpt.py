"""Decoder-only causal Transformer (GPT), after karpathy/nanoGPT `model.py`, Pre-LN, with a KV cache.

Token + learned position embeddings, Pre-LN causal blocks, a final LayerNorm and an output head tied to the token
embedding. `forward` takes and returns past keys/values, so the same graph serves the prompt pass and each
decoding step; explicit `position_ids` and an `attention_mask` over past + new slots let rows of different
lengths share one batch.
"""

from __future__ import annotations

import torch
from torch import nn

from models.config import GPTConfig
from models.layers import KeyValue, TransformerBlock, causal_mask


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        d = config.d_model
        self.token_embedding = nn.Embedding(config.vocab_size, d)
        self.position_embedding = nn.Embedding(config.context_length, d)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(d, config.n_heads, config.d_ff, config.dropout, config.activation, config.attention_dropout)
            for _ in range(config.n_layers)
        )
        self.norm = nn.LayerNorm(d)
        self.apply(self._init_weights)
        # GPT-2's scaled init for the projections that write into the residual stream.
        for name, param in self.named_parameters():
            if name.endswith(("attn.out_proj.weight", "ff.down.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / (2 * config.n_layers) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: list[KeyValue] | None = None,
    ) -> tuple[torch.Tensor, list[KeyValue]]:
        """input_ids (B, T); position_ids (B, T) (default: continue after the past); attention_mask (B, P + T),
        True/1 for real tokens (default: all); past_key_values: per layer (B, H, P, Dh) K and V, or None.
        Returns logits (B, T, V) and per-layer present K/V (B, H, P + T, Dh)."""
        B, T = input_ids.shape
        past_len = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + T, device=input_ids.device).unsqueeze(0).expand(B, T)
        if attention_mask is None:
            attention_mask = torch.ones(B, past_len + T, dtype=torch.bool, device=input_ids.device)
        x = self.dropout(self.token_embedding(input_ids) + self.position_embedding(position_ids))
        mask = causal_mask(attention_mask, T)  # (B, 1, T, P+T)
        presents = []
        for i, block in enumerate(self.blocks):
            x, present = block(x, mask, past_key_values[i] if past_key_values is not None else None)
            presents.append(present)
        logits = self.norm(x) @ self.token_embedding.weight.T  # (B, T, V), tied head
        return logits, presents
