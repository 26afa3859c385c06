"""Building blocks shared by the three models: positions, attention with a KV cache, feed-forward, Pre-LN blocks.

Follows "Attention Is All You Need" (Vaswani et al., 2017) for the sinusoidal encoding and multi-head attention,
and the Pre-LN arrangement of Xiong et al. (2020): `x + Sublayer(LayerNorm(x))`, with a final LayerNorm after the
stack. Attention is written out (matmul, mask, softmax) rather than calling a fused kernel, so that the ONNX
export is plain and the same masks drive training, cached decoding and ragged batches. Training alone takes
PyTorch's fused `scaled_dot_product_attention` with the same boolean mask (same math, ~15% faster steps on CPU);
evaluation and export always run the written-out form.

Mask convention everywhere: boolean, True means "may attend", broadcastable to (B, H, T_query, T_key).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

KeyValue = tuple[torch.Tensor, torch.Tensor]  # (B, H, T, Dh) each


def sinusoidal_table(max_len: int, d_model: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)); shape (max_len, d).

    Computed in float64 and cast to `dtype`."""
    position = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)  # (L, 1)
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)
    return table.to(dtype)


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sinusoidal table looked up by explicit positions (so cached decoding passes its own positions)."""

    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        self.register_buffer("table", sinusoidal_table(max_len, d_model), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.table[positions]  # (B, T) -> (B, T, d)


def causal_mask(key_mask: torch.Tensor, query_len: int) -> torch.Tensor:
    """Combine a key padding mask (B, K) with causality for the last `query_len` keys -> (B, 1, T, K).

    Query i sits at cache index K - T + i and may attend keys at index <= that. This holds for cached decoding
    (K = past + new) and for full recomputation (K = T) alike.
    """
    key_len = key_mask.shape[1]
    query_index = torch.arange(query_len, device=key_mask.device) + (key_len - query_len)  # (T,)
    key_index = torch.arange(key_len, device=key_mask.device)  # (K,)
    allowed = key_index.unsqueeze(0) <= query_index.unsqueeze(1)  # (T, K)
    return allowed.unsqueeze(0).unsqueeze(0) & key_mask[:, None, None, :].bool()


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention with biased Q/K/V/O projections and an optional KV cache.

    Self-attention: keys/values come from `x`, are appended to `past`, and the result is returned as `present`.
    Cross-attention: keys/values are passed in `memory_kv`, computed once per source by `project_kv(memory)`.
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)

    def project_kv(self, x: torch.Tensor) -> KeyValue:
        return self._split_heads(self.k_proj(x)), self._split_heads(self.v_proj(x))

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        past: KeyValue | None = None,
        memory_kv: KeyValue | None = None,
    ) -> tuple[torch.Tensor, KeyValue | None]:
        B, T, D = x.shape
        q = self._split_heads(self.q_proj(x))  # (B, H, T, Dh)
        if memory_kv is not None:
            k, v = memory_kv
            present = None
        else:
            k, v = self.project_kv(x)
            if past is not None:
                k = torch.cat([past[0], k], dim=2)  # (B, H, P+T, Dh)
                v = torch.cat([past[1], v], dim=2)
            present = (k, v)
        if self.training and not torch.onnx.is_in_onnx_export():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout.p)
            return self.out_proj(out.transpose(1, 2).reshape(B, T, D)), present
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, H, T, K)
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        weights = self.dropout(torch.softmax(scores, dim=-1))
        out = (weights @ v).transpose(1, 2).reshape(B, T, D)  # (B, T, D)
        return self.out_proj(out), present


class FeedForward(nn.Module):
    """Position-wise feed-forward: Linear(d, ff) -> activation -> dropout -> Linear(ff, d)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, activation: str = "relu"):
        super().__init__()
        if activation not in ("relu", "gelu"):
            raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")
        self.up = nn.Linear(d_model, d_ff)
        self.down = nn.Linear(d_ff, d_model)
        self.activation = F.relu if activation == "relu" else F.gelu
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.dropout(self.activation(self.up(x))))


class TransformerBlock(nn.Module):
    """Pre-LN self-attention block: the encoder layer, and (with a causal mask) the GPT / ViT block."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int,
        dropout: float = 0.0,
        activation: str = "relu",
        attention_dropout: float | None = None,  # on the attention weights; None: the same as `dropout`
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads, dropout if attention_dropout is None else attention_dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.ff = FeedForward(d_model, d_ff, dropout, activation)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, past: KeyValue | None = None
    ) -> tuple[torch.Tensor, KeyValue | None]:
        attended, present = self.attn(self.norm1(x), mask, past=past)
        x = x + self.dropout(attended)
        x = x + self.dropout(self.ff(self.norm2(x)))
        return x, present


class DecoderBlock(nn.Module):
    """Pre-LN decoder layer: causal self-attention (cached), cross-attention over the encoder, feed-forward."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float = 0.0, activation: str = "relu"):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout)
        self.norm3 = nn.LayerNorm(d_model)
        self.ff = FeedForward(d_model, d_ff, dropout, activation)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        self_mask: torch.Tensor,
        cross_kv: KeyValue,
        cross_mask: torch.Tensor,
        past: KeyValue | None = None,
    ) -> tuple[torch.Tensor, KeyValue]:
        attended, present = self.self_attn(self.norm1(x), self_mask, past=past)
        x = x + self.dropout(attended)
        attended, _ = self.cross_attn(self.norm2(x), cross_mask, memory_kv=cross_kv)
        x = x + self.dropout(attended)
        x = x + self.dropout(self.ff(self.norm3(x)))
        assert present is not None
        return x, present
