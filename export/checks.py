"""Parity checks run on every export: the ONNX graphs must compute what the PyTorch model computes.

- logits within `ATOL` (fp32) of PyTorch on real inputs, padded batches included, for the prompt/encoder pass and
  for a cached step;
- identical greedy outputs on 50 validation prompts / sentences, decoded by the ONNX Runtime engine on one side
  and by the PyTorch model (same decoding code) on the other;
- identical ViT argmax on 1,000 test images.
A failed check raises `ExportCheckError`; the results go into the model card. `gpt_validation_loss` and
`vit_test_accuracy` measure the exported graph's quality on the card's own data (after any weight compression).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from models.generate import generate_ids
from models.translate import translate_ids
from service.decoding import GreedySearch
from service.engines import onnx_schema as schema
from service.engines.gpt import GPTEngine
from service.engines.kv_cache import KVCache
from service.engines.translation import TranslationEngine
from service.engines.vit import ViTEngine

ATOL = 1e-4


class ExportCheckError(Exception):
    pass


def _max_diff(a: np.ndarray, b: torch.Tensor | np.ndarray) -> float:
    b = b.detach().numpy() if isinstance(b, torch.Tensor) else b
    return float(np.abs(a - b).max())


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ExportCheckError(message)


def left_padded(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prompts of different lengths as one left-padded batch: (ids, mask, positions), each (B, longest)."""
    longest = max(len(p) for p in prompts)
    ids, mask, positions = (np.zeros((len(prompts), longest), np.int64) for _ in range(3))
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        ids[row, longest - n :], mask[row, longest - n :], positions[row, longest - n :] = prompt, 1, np.arange(n)
    return ids, mask, positions


def check_gpt(model, engine: GPTEngine, prompts: list[list[int]], max_new_tokens: int = 24) -> dict[str, Any]:
    """`prompts`: real validation prompts of different lengths (token ids)."""
    with torch.no_grad():
        ids, mask, positions = left_padded(prompts[:8])
        empty = {name: np.zeros((len(ids), engine.n_heads, 0, engine.head_dim), np.float32)
                 for i in range(engine.n_layers) for name in schema.past_names(i)}
        feeds = {schema.INPUT_IDS: ids, schema.POSITION_IDS: positions, schema.ATTENTION_MASK: mask, **empty}
        onnx_logits, *presents = engine.session.run(None, feeds)
        torch_logits, past = model(torch.from_numpy(ids), torch.from_numpy(positions), torch.from_numpy(mask).bool())
        real = mask.astype(bool)
        prompt_diff = _max_diff(onnx_logits[real], torch_logits.numpy()[real])

        step_ids = np.full((len(ids), 1), 7, np.int64)
        step_positions = mask.sum(1, keepdims=True)
        step_mask = np.concatenate([mask, np.ones((len(ids), 1), np.int64)], axis=1)
        feeds = {schema.INPUT_IDS: step_ids, schema.POSITION_IDS: step_positions, schema.ATTENTION_MASK: step_mask}
        feeds.update({name: presents[j] for j, name in enumerate(n for i in range(engine.n_layers)
                                                                 for n in schema.past_names(i))})
        onnx_step = engine.session.run(None, feeds)[0]
        torch_step, _ = model(torch.from_numpy(step_ids), torch.from_numpy(step_positions),
                              torch.from_numpy(step_mask).bool(), past)
        step_diff = _max_diff(onnx_step, torch_step)
        _require(max(prompt_diff, step_diff) <= ATOL,
                 f"GPT logits differ from PyTorch by {max(prompt_diff, step_diff):.2e} (> {ATOL})")

        def make(_):
            return GreedySearch(max_new_tokens=max_new_tokens, eos_token_id=engine.eos_id)

        onnx_out = [s.results()[0].tokens for s in engine.generate(prompts, make)]
        torch_out = [s.results()[0].tokens for s in generate_ids(model, prompts, make)]
        mismatches = sum(a != b for a, b in zip(onnx_out, torch_out))
        _require(mismatches == 0, f"greedy GPT outputs differ from PyTorch on {mismatches} of {len(prompts)} prompts")
        return {"logits_max_abs_diff_prompt": prompt_diff, "logits_max_abs_diff_step": step_diff,
                "greedy_identical": f"{len(prompts) - mismatches}/{len(prompts)}"}


def check_translation(model, engine: TranslationEngine, sources: list[list[int]], targets: list[list[int]]
                      ) -> dict[str, Any]:
    """`sources`: real validation sentences as ids + EOS; `targets`: their references as ids (no BOS/EOS)."""
    with torch.no_grad():
        batch_sources = sources[:8]
        encoded = engine.encode(batch_sources)
        src = torch.from_numpy(_pad_ids(batch_sources, encoded.mask.shape[1]))
        src_mask = torch.from_numpy(encoded.mask).bool()
        cross = model.cross_attention_kv(model.encode(src, src_mask))
        torch_cross = [t for pair in cross for t in pair]
        encoder_diff = max(_max_diff(a, b) for a, b in zip(encoded.cross, torch_cross))

        # Teacher-forced target prefixes of different lengths, right-padded, as one decoder call with an empty past.
        prefixes = [[engine.bos_id] + t[: 3 + i % 5] for i, t in enumerate(targets[:8])]
        length = max(len(p) for p in prefixes)
        ids, mask = np.zeros((8, length), np.int64), np.zeros((8, length), np.int64)
        for row, prefix in enumerate(prefixes):
            ids[row, : len(prefix)], mask[row, : len(prefix)] = prefix, 1
        positions = np.tile(np.arange(length), (8, 1))
        rows = np.arange(8, dtype=np.int64)
        feeds = {schema.INPUT_IDS: ids, schema.POSITION_IDS: positions, schema.ATTENTION_MASK: mask,
                 schema.ENCODER_ATTENTION_MASK: encoded.mask, schema.ENCODER_ROW: rows}
        for i in range(engine.n_layers):
            key_name, value_name = schema.past_names(i)
            feeds[key_name] = feeds[value_name] = np.zeros((8, engine.n_heads, 0, engine.head_dim), np.float32)
            key_name, value_name = schema.cross_names(i)
            feeds[key_name], feeds[value_name] = encoded.cross[2 * i], encoded.cross[2 * i + 1]
        onnx_logits = engine.decoder.run(None, feeds)[0]
        torch_logits, _ = model.decode_step(torch.from_numpy(ids), torch.from_numpy(positions),
                                            torch.from_numpy(mask).bool(), cross, src_mask)
        real = mask.astype(bool)
        decoder_diff = _max_diff(onnx_logits[real], torch_logits.numpy()[real])
        worst = max(encoder_diff, decoder_diff)
        _require(worst <= ATOL, f"translation graphs differ from PyTorch by {worst:.2e} (> {ATOL})")

        def make(i):
            return GreedySearch(max_new_tokens=engine.default_max_new_tokens(len(sources[i])),
                                eos_token_id=engine.eos_id)

        onnx_out = [s.results()[0].tokens for s in engine.translate_ids(sources, make)]
        torch_out = [s.results()[0].tokens for s in translate_ids(model, sources, num_beams=1)]
        mismatches = sum(a != b for a, b in zip(onnx_out, torch_out))
        _require(mismatches == 0,
                 f"greedy translations differ from PyTorch on {mismatches} of {len(sources)} sentences")
        return {"cross_kv_max_abs_diff": encoder_diff, "logits_max_abs_diff": decoder_diff,
                "greedy_identical": f"{len(sources) - mismatches}/{len(sources)}"}


def _pad_ids(sequences: list[list[int]], length: int) -> np.ndarray:
    ids = np.zeros((len(sequences), length), np.int64)
    for row, s in enumerate(sequences):
        ids[row, : len(s)] = s
    return ids


def _vit_onnx_logits(engine: ViTEngine, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images (N, H, W) preprocessed as the server does -> (pixel batch, ONNX logits), 250 images a call."""
    from PIL import Image

    batch = np.stack([engine.preprocess(Image.fromarray(image)) for image in images])
    return batch, np.concatenate([engine.logits(batch[i : i + 250]) for i in range(0, len(batch), 250)])


def check_vit(model, engine: ViTEngine, images: np.ndarray) -> dict[str, Any]:
    """`images`: real test images, uint8 (N, H, W)."""
    with torch.no_grad():
        batch, onnx_logits = _vit_onnx_logits(engine, images)
        torch_logits = torch.cat([model(torch.from_numpy(batch[i : i + 250])) for i in range(0, len(batch), 250)])
        diff = _max_diff(onnx_logits, torch_logits)
        same = int((onnx_logits.argmax(1) == torch_logits.argmax(1).numpy()).sum())
        _require(diff <= ATOL, f"ViT logits differ from PyTorch by {diff:.2e} (> {ATOL})")
        _require(same == len(images),
                 f"ViT argmax differs from PyTorch on {len(images) - same} of {len(images)} images")
        return {"logits_max_abs_diff": diff, "argmax_identical": f"{same}/{len(images)}"}


def _windows(ids: np.ndarray, length: int, batch_size: int):
    """Consecutive windows of `length` tokens of `ids` and their next tokens, `batch_size` windows at a time:
    (inputs, targets), each (rows, length)."""
    n_windows = (len(ids) - 1) // length
    inputs = ids[: n_windows * length].reshape(n_windows, length)
    targets = ids[1 : n_windows * length + 1].reshape(n_windows, length)
    for start in range(0, n_windows, batch_size):
        yield inputs[start : start + batch_size], targets[start : start + batch_size]


def gpt_validation_loss(engine: GPTEngine, ids: np.ndarray, batch_size: int = 32) -> float:
    """Mean next-token loss (nats) of the ONNX graph over consecutive context-length windows of `ids`: the same
    windows `GPTTask.validation_loss` scores in PyTorch, so the two numbers compare directly."""
    T = engine.context_length
    total, scored = 0.0, 0
    for x, y in _windows(ids, T, batch_size):
        rows = len(x)
        feeds = {schema.INPUT_IDS: x, schema.POSITION_IDS: np.tile(np.arange(T, dtype=np.int64), (rows, 1)),
                 schema.ATTENTION_MASK: np.ones((rows, T), np.int64),
                 **KVCache.empty(rows, engine.n_layers, engine.n_heads, engine.head_dim).feeds()}
        total += _next_token_loss(engine.session.run([schema.LOGITS], feeds)[0], y)  # logits (rows, T, V)
        scored += y.size
    return total / scored


def _next_token_loss(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed -log p(target) of float logits (..., V), in float64."""
    logits = logits.astype(np.float64)
    peak = logits.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(logits - peak).sum(axis=-1)) + peak[..., 0]
    return float((log_norm - np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]).sum())


def gpt_step_validation_loss(engine: GPTEngine, ids: np.ndarray, batch_size: int = 64) -> float:
    """`gpt_validation_loss` through the decoding steps instead of one prompt pass: each window's first token is
    the prompt, every later one is fed by `GPTEngine.step` (the in-place step graph where the version has one), and
    the logits of each step are scored against the next token. The same windows and targets, so the figure
    compares with the prompt pass's and the card's; it measures what generation runs."""
    total, scored = 0.0, 0
    for x, y in _windows(ids, engine.context_length, batch_size):
        logits, cache = engine.prefill(x[:, :1].tolist())
        total += _next_token_loss(logits, y[:, 0])
        for t in range(1, x.shape[1]):
            total += _next_token_loss(engine.step(cache, x[:, t]), y[:, t])
        scored += y.size
    return total / scored


def vit_test_accuracy(engine: ViTEngine, images: np.ndarray, labels: np.ndarray) -> float:
    """Top-1 accuracy (percent) of the ONNX graph on uint8 images (N, H, W), preprocessed as the server does."""
    _, logits = _vit_onnx_logits(engine, images)
    return 100.0 * int((logits.argmax(1) == labels).sum()) / len(images)
