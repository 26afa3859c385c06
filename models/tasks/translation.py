"""Translation training task (Multi30k de->en): token-budget batches, label-smoothed teacher forcing, BLEU.

Source = German ids + </s>; target = <s> + English ids + </s>. The decoder reads target[:-1] and is trained to
predict target[1:] (teacher forcing) with cross-entropy smoothed by epsilon = 0.1. Batches group sentences of
similar length up to `batch_tokens` padded tokens, in an order shuffled per epoch. The final evaluation decodes
with greedy search and beam search and scores with sacreBLEU (cased, default 13a tokenisation).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import torch
from tokenizers import Tokenizer
from torch.nn import functional as F

from models.config import TrainConfig, TranslationConfig
from models.transformer import EncoderDecoderTransformer

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # src, src_mask, tgt, tgt_mask


def encode_pairs(tokenizer: Tokenizer, pairs: Sequence[tuple[str, str]], config: TranslationConfig
                 ) -> list[tuple[list[int], list[int]]]:
    """(German, English) text -> (source ids + EOS, BOS + target ids + EOS), dropping pairs too long to embed."""
    german = tokenizer.encode_batch([de for de, _ in pairs])
    english = tokenizer.encode_batch([en for _, en in pairs])
    encoded = []
    for de, en in zip(german, english):
        src = de.ids + [config.eos_id]
        tgt = [config.bos_id] + en.ids + [config.eos_id]
        if len(src) <= config.max_positions and len(tgt) <= config.max_positions:
            encoded.append((src, tgt))
    return encoded


def pad(sequences: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to a (B, T) id tensor and its boolean mask (True for real tokens)."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    for row, s in enumerate(sequences):
        ids[row, : len(s)] = torch.tensor(s, dtype=torch.long)
    return ids, ids != pad_id


def token_budget_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by length so that rows x longest row <= batch_tokens (at least one row per batch)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current, longest = [], [], 0
    for i in order:
        longest_if_added = max(longest, lengths[i])
        if current and longest_if_added * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest_if_added = [], lengths[i]
        current.append(i)
        longest = longest_if_added
    if current:
        batches.append(current)
    return batches


class TranslationTask:
    def __init__(self, config: TranslationConfig, train_cfg: TrainConfig, tokenizer: Tokenizer,
                 train_pairs: Sequence[tuple[str, str]], val_pairs: Sequence[tuple[str, str]]):
        self.config = config
        self.train_cfg = train_cfg
        self.tokenizer = tokenizer
        if train_cfg.train_limit is not None:
            train_pairs = train_pairs[: train_cfg.train_limit]
        self.train = encode_pairs(tokenizer, train_pairs, config)
        self.val = encode_pairs(tokenizer, val_pairs, config)
        budget = train_cfg.batch_tokens or 4000
        self._batches = token_budget_batches([max(len(s), len(t)) for s, t in self.train], budget)

    def steps_per_epoch(self) -> int:
        return len(self._batches)

    def _collate(self, examples: Sequence[tuple[list[int], list[int]]]) -> Batch:
        src, src_mask = pad([s for s, _ in examples], self.config.pad_id)
        tgt, tgt_mask = pad([t for _, t in examples], self.config.pad_id)
        return src, src_mask, tgt, tgt_mask

    def batches(self, epoch: int) -> Iterator[Batch]:
        order = list(range(len(self._batches)))
        random.Random(self.train_cfg.seed * 1_000_003 + epoch).shuffle(order)
        for b in order:
            yield self._collate([self.train[i] for i in self._batches[b]])

    def _loss(self, model: EncoderDecoderTransformer, batch: Batch, label_smoothing: float,
              reduction: str = "mean") -> tuple[torch.Tensor, int]:
        src, src_mask, tgt, tgt_mask = batch
        logits = model(src, tgt[:, :-1], src_mask, tgt_mask[:, :-1])  # (B, T-1, V)
        targets = tgt[:, 1:].masked_fill(~tgt_mask[:, 1:], -100)  # padding is ignored
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                               label_smoothing=label_smoothing, reduction=reduction)
        return loss, int(tgt_mask[:, 1:].sum())

    def loss(self, model: EncoderDecoderTransformer, batch: Batch) -> tuple[torch.Tensor, int]:
        return self._loss(model, batch, self.train_cfg.label_smoothing)

    @torch.no_grad()
    def validation_loss(self, model: EncoderDecoderTransformer) -> float:
        """Plain (unsmoothed) cross-entropy per target token on the validation set."""
        model.eval()
        total, tokens = 0.0, 0
        for indices in token_budget_batches([max(len(s), len(t)) for s, t in self.val], 4000):
            loss, n = self._loss(model, self._collate([self.val[i] for i in indices]), 0.0, reduction="sum")
            total, tokens = total + loss.item(), tokens + n
        return total / tokens
