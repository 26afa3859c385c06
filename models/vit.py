"""Vision Transformer (Dosovitskiy et al., 2021), laid out like timm's `vision_transformer.py`.

Patch embedding as `Conv2d(kernel=stride=patch)` (equal to "cut into patches, flatten, one linear layer") or, with
`config.stem_widths`, a convolutional stem (Xiao et al., 2021: 3x3 stride-2 convolutions with BatchNorm and ReLU,
then a 1x1 convolution to d_model; timm's `ConvStem`), a learned [CLS] token, learned position embeddings, a
Pre-LN encoder with a final LayerNorm;
`forward_features` (all tokens) -> the [CLS] token -> `head` (class logits).
With `config.distillation`, DeiT's distillation token (Touvron et al., 2021; timm's
`VisionTransformerDistilled`): a second learned token after [CLS] with its own head, trained to predict a
teacher's labels (`forward_heads`); the model's logits are the mean of the two heads' logits in every mode.
With `config.flip_average`, eval mode averages the logits of each image and its horizontal mirror (test-time
augmentation, as in the ten-crop evaluation of Krizhevsky et al., 2012, reduced to the flip).
"""

from __future__ import annotations

import torch
from torch import nn

from models.config import ViTConfig
from models.layers import TransformerBlock


def conv_stem(channels: int, widths: tuple[int, ...], d_model: int) -> nn.Sequential:
    """Xiao et al.'s stem: per width a 3x3 stride-2 convolution (no bias), BatchNorm and ReLU; then a 1x1
    convolution to d_model (the token embedding)."""
    layers: list[nn.Module] = []
    previous = channels
    for width in widths:
        layers += [nn.Conv2d(previous, width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(width),
                   nn.ReLU(inplace=True)]
        previous = width
    return nn.Sequential(*layers, nn.Conv2d(previous, d_model, 1))


class ViT(nn.Module):
    def __init__(self, config: ViTConfig):
        super().__init__()
        if not config.stem_widths and config.image_size % config.patch_size:
            raise ValueError(f"image_size={config.image_size} is not a multiple of patch_size={config.patch_size}")
        self.config = config
        d = config.d_model
        if config.stem_widths:
            self.patch_embed = conv_stem(config.channels, config.stem_widths, d)
        else:
            self.patch_embed = nn.Conv2d(config.channels, d, kernel_size=config.patch_size, stride=config.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, d)) if config.distillation else None
        self.pos_embed = nn.Parameter(torch.zeros(1, config.num_prefix_tokens + config.num_patches, d))
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(d, config.n_heads, config.d_ff, config.dropout, config.activation)
            for _ in range(config.n_layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, config.num_classes)
        self.head_dist = nn.Linear(d, config.num_classes) if config.distillation else None
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        if self.dist_token is not None:
            nn.init.trunc_normal_(self.dist_token, std=0.02)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)

    def forward_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (B, C, H, W), already normalised -> tokens (B, P + N, d) after the final LayerNorm, P prefix
        tokens ([CLS], then the distillation token if any)."""
        x = self.patch_embed(pixels)  # (B, d, grid, grid)
        x = x.flatten(2).transpose(1, 2)  # (B, N, d)
        prefix = [self.cls_token] + ([self.dist_token] if self.dist_token is not None else [])
        prefix = [token.expand(x.shape[0], -1, -1) for token in prefix]  # P x (B, 1, d)
        x = self.dropout(torch.cat([*prefix, x], dim=1) + self.pos_embed)  # (B, P + N, d)
        for block in self.blocks:
            x, _ = block(x)
        return self.norm(x)

    def forward_heads(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(class logits from [CLS], the distillation head's logits or None), each (B, num_classes)."""
        tokens = self.forward_features(pixels)
        dist = self.head_dist(tokens[:, 1]) if self.head_dist is not None else None
        return self.head(tokens[:, 0]), dist

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (B, C, H, W) -> logits (B, num_classes): the [CLS] head's, averaged with the distillation
        head's when there is one (DeiT's inference rule); in eval mode with `config.flip_average`, averaged over the
        image and its mirror image, run as one batch."""
        if self.training or not self.config.flip_average:
            return self._head_logits(pixels)
        both = self._head_logits(torch.cat([pixels, pixels.flip(-1)]))  # (2B, num_classes)
        return both.view(2, -1, self.config.num_classes).mean(0)

    def _head_logits(self, pixels: torch.Tensor) -> torch.Tensor:
        logits, dist = self.forward_heads(pixels)
        return logits if dist is None else (logits + dist) / 2
