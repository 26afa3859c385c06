"""GPT training task: random windows of a token stream (nanoGPT's `get_batch`), next-token cross-entropy.

Validation loss is the mean next-token cross-entropy over non-overlapping windows of the held-out stream, in nats
per token; for the byte tokenizer on ASCII text that is nats per character. Batches are made on the CPU and moved
to the model's device (a GPU when `python -m models.train --device cuda`), as nanoGPT's `get_batch` does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.nn import functional as F

from models.config import GPTConfig, TrainConfig
from models.gpt import GPT


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


class GPTTask:
    def __init__(self, config: GPTConfig, train_cfg: TrainConfig, train_ids: np.ndarray, val_ids: np.ndarray):
        self.config = config
        self.train_cfg = train_cfg
        self.train_ids = torch.from_numpy(np.asarray(train_ids, dtype=np.int64))
        val = np.asarray(val_ids, dtype=np.int64)
        if train_cfg.eval_limit is not None:
            val = val[: train_cfg.eval_limit]
        self.val_ids = torch.from_numpy(val)
        if len(self.train_ids) <= config.context_length + 1 or len(self.val_ids) <= config.context_length + 1:
            raise ValueError(f"need more than {config.context_length + 1} tokens of training and validation text")

    def steps_per_epoch(self) -> int:
        """One epoch = as many windows as it takes to see the training stream's length in tokens once."""
        return max(1, len(self.train_ids) // (self.train_cfg.batch_size * self.config.context_length))

    def batches(self, epoch: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        generator = torch.Generator().manual_seed(self.train_cfg.seed * 1_000_003 + epoch)
        T = self.config.context_length
        for _ in range(self.steps_per_epoch()):
            starts = torch.randint(0, len(self.train_ids) - T - 1, (self.train_cfg.batch_size,), generator=generator)
            windows = torch.stack([self.train_ids[s : s + T + 1] for s in starts.tolist()])  # (B, T+1)
            yield windows[:, :-1], windows[:, 1:]

    def loss(self, model: GPT, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
        device = _device_of(model)
        inputs, targets = (t.to(device, non_blocking=True) for t in batch)
        logits, _ = model(inputs)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()), targets.numel()

    @torch.no_grad()
    def validation_loss(self, model: GPT, batch_size: int = 32) -> float:
        model.eval()
        T = self.config.context_length
        n_windows = (len(self.val_ids) - 1) // T
        inputs = self.val_ids[: n_windows * T].view(n_windows, T)
        targets = self.val_ids[1 : n_windows * T + 1].view(n_windows, T)
        device = _device_of(model)
        inputs, targets = inputs.to(device), targets.to(device)
        total = 0.0
        for i in range(0, n_windows, batch_size):
            logits, _ = model(inputs[i : i + batch_size])
            total += F.cross_entropy(logits.flatten(0, 1), targets[i : i + batch_size].flatten(), reduction="sum").item()
        return total / targets.numel()

    def evaluate(self, model: GPT) -> dict[str, float]:
        val_loss = self.validation_loss(model)
        return {
            "val_loss": round(val_loss, 4),
            "val_perplexity": round(math.exp(val_loss), 4),
            "val_bits_per_token": round(val_loss / math.log(2), 4),
            "uniform_baseline_loss": round(math.log(self.config.vocab_size), 4),
            "val_tokens": int(len(self.val_ids)),
        }
