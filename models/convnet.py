"""The ViT's distillation teacher: a small VGG-style CNN (Simonyan & Zisserman, 2015) with BatchNorm.

DeiT (Touvron et al., 2021) distils a ViT from a convolutional teacher, whose locality the student lacks on small
datasets. Three stages of two (3x3 conv, BatchNorm, ReLU), 2x2 max-pooling between stages, global average pooling,
dropout, one linear classifier. Runs channels-last (faster on CPU). Trained with the ViT's task; never served.
"""

from __future__ import annotations

import torch
from torch import nn

from models.config import ConvNetConfig


def _conv_bn_relu(in_channels: int, out_channels: int) -> list[nn.Module]:
    return [nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False), nn.BatchNorm2d(out_channels),
            nn.ReLU(inplace=True)]


class ConvNet(nn.Module):
    def __init__(self, config: ConvNetConfig):
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        previous = config.channels
        for stage, width in enumerate(config.widths):
            if stage:
                layers.append(nn.MaxPool2d(2))
            layers += _conv_bn_relu(previous, width) + _conv_bn_relu(width, width)
            previous = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(config.dropout)
        self.head = nn.Linear(previous, config.num_classes)
        self.to(memory_format=torch.channels_last)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels (B, C, H, W), standardised -> logits (B, num_classes)."""
        x = self.features(pixels.contiguous(memory_format=torch.channels_last))
        return self.head(self.dropout(self.pool(x).flatten(1)))
