"""Vision Transformer (Dosovitskiy et al., 2021), laid out like timm's `vision_transformer.py`.

Patch embedding as `Conv2d(kernel=stride=patch)` (equal to "cut into patches, flatten, one linear layer"),
a learned [CLS] token, learned position embeddings, a Pre-LN encoder with a final LayerNorm;
`forward_features` (all tokens) -> pool the [CLS] token -> `forward_head` (class logits).
"""

from __future__ import annotations

import torch
from torch import nn

from models.config import ViTConfig
from models.layers import TransformerBlock


class ViT(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        if config.image_size % config.patch_size:
            raise ValueError(f"image_size={config.image_size} is not a multiple of patch_size={config.patch_size}")
        self.config = config
        d = config.d_model
        self.patch_embed = nn.Conv2d(config.channels, d, kernel_size=config.patch_size, stride=config.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, config.num_patches + 1, d))
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(d, config.n_heads, config.d_ff, config.dropout, config.activation)
            for _ in range(config.n_layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, config.num_classes)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)

    def forward_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (B, C, H, W), already normalised -> tokens (B, 1 + N, d) after the final LayerNorm."""
        x = self.patch_embed(pixels)  # (B, d, H/p, W/p)
        x = x.flatten(2).transpose(1, 2)  # (B, N, d)
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # (B, 1, d)
        x = self.dropout(torch.cat([cls, x], dim=1) + self.pos_embed)  # (B, 1 + N, d)
        for block in self.blocks:
            x, _ = block(x)
        return self.norm(x)

    def forward_head(self, tokens: torch.Tensor) -> torch.Tensor:
        """Pool the [CLS] token and classify: (B, 1 + N, d) -> logits (B, num_classes)."""
        return self.head(tokens[:, 0])

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(pixels))
