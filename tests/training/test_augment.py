"""ViT training augmentation: pad-and-crop shifts by at most the padding; flips only when asked."""

from __future__ import annotations

import torch

from models.tasks.vit import augment


def _dot_images(n: int) -> torch.Tensor:
    images = torch.full((n, 1, 28, 28), -1.0)  # standardised black background
    images[:, 0, 10, 5] = 3.0  # one bright pixel near the left edge
    return images


def _bright_columns(images: torch.Tensor) -> torch.Tensor:
    return images[:, 0].amax(dim=1).argmax(dim=1)  # column of the bright pixel, per image


def test_crop_only_shifts_within_the_padding_and_never_mirrors():
    out = augment(_dot_images(256), torch.Generator().manual_seed(0), pad=2, flip=False)
    columns = _bright_columns(out)
    assert columns.min() >= 3 and columns.max() <= 7
    assert len(set(columns.tolist())) == 5  # every shift of -2..2 occurs
    assert (out == -1.0).sum(dim=(1, 2, 3)).eq(28 * 28 - 1).all()  # padding filled with the background value


def test_flip_mirrors_about_half_of_the_images():
    columns = _bright_columns(augment(_dot_images(256), torch.Generator().manual_seed(0), pad=2, flip=True))
    mirrored = (columns >= 20).sum().item()  # 27 - 5 = 22, +- 2
    assert 96 <= mirrored <= 160 and ((columns <= 7) | (columns >= 20)).all()
