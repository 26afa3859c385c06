"""ViT training task: Fashion-MNIST images standardised by the model config's mean/std, optional augmentation
(pad 2 + random crop, and a horizontal flip unless `augment_flip` is off), label-smoothed cross-entropy;
choices (the curve, `keep_best`) on a validation split held out of the training images, and top-1 test accuracy
measured once, at the end. With a teacher (DeiT's hard distillation, Touvron et al., 2021), a student with a
distillation token learns the true labels on its [CLS] head and the teacher's argmax on the augmented image on its
distillation head, the two losses weighted equally."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from models.config import ConvNetConfig, TrainConfig, ViTConfig


def normalise(images: np.ndarray, config: ViTConfig) -> torch.Tensor:
    """uint8 (N, H, W) or (N, C, H, W) -> float32 (N, C, H, W), scaled to [0, 1] then standardised."""
    x = torch.from_numpy(np.asarray(images)).float().div_(255.0)
    if x.dim() == 3:
        x = x.unsqueeze(1)
    return (x - config.mean) / config.std


def augment(batch: torch.Tensor, generator: torch.Generator, pad: int = 2, flip: bool = True) -> torch.Tensor:
    """Random crop after zero-padding (in the standardised space, pad with the value of a black pixel) and, with
    `flip`, a random horizontal flip."""
    B, C, H, W = batch.shape
    background = batch.amin()
    padded = F.pad(batch, (pad, pad, pad, pad), value=float(background))
    dx = torch.randint(0, 2 * pad + 1, (B,), generator=generator)
    dy = torch.randint(0, 2 * pad + 1, (B,), generator=generator)
    rows = (dy[:, None] + torch.arange(H)[None, :])[:, None, :, None].expand(B, C, H, W + 2 * pad)  # (B, C, H, W+2p)
    cropped = torch.gather(padded, 2, rows)
    cols = (dx[:, None] + torch.arange(W)[None, :])[:, None, None, :].expand(B, C, H, W)
    cropped = torch.gather(cropped, 3, cols)  # (B, C, H, W)
    if not flip:
        return cropped
    flipped = torch.rand(B, generator=generator) < 0.5
    return torch.where(flipped[:, None, None, None], cropped.flip(-1), cropped)


class ViTTask:
    """Fashion-MNIST training. With `validation_size` N, the LAST N training images (after `train_limit`) are held
    out as the validation split: the validation loss (the curve, `keep_best`) is measured on them, and the test set
    is only measured by `evaluate`, once, at the end. Without it the validation loss is the test set's (none of the
    presets does that any more)."""

    def __init__(self, config: ViTConfig | ConvNetConfig, train_cfg: TrainConfig,
                 train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                 teacher: nn.Module | None = None):
        self.config = config
        self.teacher = teacher.eval().requires_grad_(False) if teacher is not None else None
        self.train_cfg = train_cfg
        images, labels = train
        if train_cfg.train_limit is not None:
            images, labels = images[: train_cfg.train_limit], labels[: train_cfg.train_limit]
        held_out = train_cfg.validation_size or 0
        if not 0 <= held_out < len(images):
            raise ValueError(f"validation_size {held_out} must leave training images (there are {len(images)})")
        test_images, test_labels = test
        if train_cfg.eval_limit is not None:
            test_images, test_labels = test_images[: train_cfg.eval_limit], test_labels[: train_cfg.eval_limit]
        val_images, val_labels = (images[-held_out:], labels[-held_out:]) if held_out else (test_images, test_labels)
        if held_out:
            images, labels = images[:-held_out], labels[:-held_out]
        self.train_x, self.train_y = normalise(images, config), torch.as_tensor(labels, dtype=torch.long)
        self.val_x, self.val_y = normalise(val_images, config), torch.as_tensor(val_labels, dtype=torch.long)
        self.test_x, self.test_y = normalise(test_images, config), torch.as_tensor(test_labels, dtype=torch.long)
        self.held_out = held_out

    def steps_per_epoch(self) -> int:
        return len(self.train_x) // self.train_cfg.batch_size  # drop the last partial batch

    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.train_cfg.seed * 1_000_003 + epoch)
        order = torch.randperm(len(self.train_x), generator=generator)
        B = self.train_cfg.batch_size
        for i in range(self.steps_per_epoch()):
            index = order[i * B : (i + 1) * B]
            x = self.train_x[index]
            if self.train_cfg.augment:
                x = augment(x, generator, flip=self.train_cfg.augment_flip)
            yield x, self.train_y[index]

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        x, y = batch
        smoothing = self.train_cfg.label_smoothing
        if self.teacher is None:
            return F.cross_entropy(model(x), y, label_smoothing=smoothing), len(y)
        logits, dist = model.forward_heads(x)
        with torch.no_grad():
            taught = self.teacher(x).argmax(-1)
        loss = F.cross_entropy(logits, y, label_smoothing=smoothing) + F.cross_entropy(dist, taught)
        return loss / 2, len(y)

    @torch.no_grad()
    def _logits(self, model: nn.Module, images: torch.Tensor, batch_size: int = 500) -> torch.Tensor:
        model.eval()
        return torch.cat([model(images[i : i + batch_size]) for i in range(0, len(images), batch_size)])

    def validation_loss(self, model: nn.Module) -> float:
        return F.cross_entropy(self._logits(model, self.val_x), self.val_y).item()

    def validation_accuracy(self, model: nn.Module) -> float:
        """Top-1 accuracy (percent, 2 places) on the validation split (the test set's when there is none)."""
        return _accuracy(self._logits(model, self.val_x), self.val_y)

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Validation and test accuracy and loss of `model` (the test set's only use)."""
        metrics: dict[str, float] = {}
        splits = [("val", self.val_x, self.val_y)] if self.held_out else []
        for split, images, labels in splits + [("test", self.test_x, self.test_y)]:
            logits = self._logits(model, images)
            metrics[f"{split}_accuracy"] = _accuracy(logits, labels)
            metrics[f"{split}_loss"] = round(F.cross_entropy(logits, labels).item(), 4)
            metrics[f"{split}_images"] = len(labels)
        return metrics


def _accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return round(100.0 * (logits.argmax(-1) == labels).float().mean().item(), 2)
