"""Export the three models to ONNX (TorchScript exporter, opset 17) and describe them in `config.json`.

Every graph is checked with `onnx.checker.check_model(full_check=True)` right after export. Sample inputs use a
non-empty past so that the traced graph keeps the concatenation; the past axis is dynamic and may be empty.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import onnx
import torch

from export.graphs import DecoderStepGraph, EncoderGraph, GPTDecoderGraph, ViTGraph
from models.config import GPTConfig, TranslationConfig, ViTConfig
from models.data import FASHION_MNIST_LABELS
from service.engines import onnx_schema as schema
OPSET = 17


def export_graph(module: torch.nn.Module, args: tuple, path: Path, spec: schema.GraphSpec) -> Path:
    module.eval()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        torch.onnx.export(module, args, str(path), input_names=list(spec.inputs), output_names=list(spec.outputs),
                          dynamic_axes=spec.dynamic_axes, opset_version=OPSET, do_constant_folding=True,
                          dynamo=False)
    onnx.checker.check_model(str(path), full_check=True)
    return path


def _past(rows: int, layers: int, heads: int, head_dim: int, length: int) -> list[torch.Tensor]:
    return [torch.randn(rows, heads, length, head_dim) for _ in range(2 * layers)]


def export_gpt(model, config: GPTConfig, out_dir: Path) -> dict[str, Any]:
    head_dim = config.d_model // config.n_heads
    ids = torch.randint(0, config.vocab_size, (2, 3))
    positions = torch.arange(4, 7).expand(2, 3)
    mask = torch.ones(2, 7, dtype=torch.long)
    past = _past(2, config.n_layers, config.n_heads, head_dim, 4)
    export_graph(GPTDecoderGraph(model), (ids, positions, mask, *past), out_dir / schema.GPT_DECODER_FILE,
                 schema.gpt_decoder_spec(config.n_layers))
    return {
        "kind": "gpt",
        "files": {"decoder": schema.GPT_DECODER_FILE},
        "architecture": {"vocab_size": config.vocab_size, "d_model": config.d_model, "n_heads": config.n_heads,
                         "head_dim": head_dim, "n_layers": config.n_layers, "d_ff": config.d_ff},
        "special_tokens": {"eos_id": config.eos_id},
        "context_length": config.context_length,
    }


def export_translation(model, config: TranslationConfig, out_dir: Path) -> dict[str, Any]:
    head_dim = config.d_model // config.n_heads
    layers = config.n_decoder_layers
    src = torch.randint(4, config.vocab_size, (2, 5))
    src_mask = torch.ones(2, 5, dtype=torch.long)
    export_graph(EncoderGraph(model), (src, src_mask), out_dir / schema.ENCODER_FILE, schema.encoder_spec(layers))
    ids = torch.randint(4, config.vocab_size, (3, 1))
    positions = torch.full((3, 1), 4)
    mask = torch.ones(3, 5, dtype=torch.long)
    encoder_row = torch.tensor([0, 1, 1])
    past = _past(3, layers, config.n_heads, head_dim, 4)
    cross = _past(2, layers, config.n_heads, head_dim, 5)
    export_graph(DecoderStepGraph(model), (ids, positions, mask, src_mask, encoder_row, *past, *cross),
                 out_dir / schema.DECODER_FILE, schema.decoder_spec(layers))
    return {
        "kind": "translation",
        "files": {"encoder": schema.ENCODER_FILE, "decoder": schema.DECODER_FILE},
        "architecture": {"vocab_size": config.vocab_size, "d_model": config.d_model, "n_heads": config.n_heads,
                         "head_dim": head_dim, "n_encoder_layers": config.n_encoder_layers,
                         "n_decoder_layers": layers, "d_ff": config.d_ff},
        "special_tokens": {"pad_id": config.pad_id, "bos_id": config.bos_id, "eos_id": config.eos_id},
        "max_source_length": config.max_positions,
        "max_target_length": config.max_positions,
        "languages": {"source": "de", "target": "en"},
    }


def export_vit(model, config: ViTConfig, out_dir: Path) -> dict[str, Any]:
    pixels = torch.randn(2, config.channels, config.image_size, config.image_size)
    export_graph(ViTGraph(model), (pixels,), out_dir / schema.VIT_FILE, schema.vit_spec())
    return {
        "kind": "vit",
        "files": {"model": schema.VIT_FILE},
        "architecture": {"d_model": config.d_model, "n_heads": config.n_heads, "n_layers": config.n_layers,
                         "d_ff": config.d_ff, "num_classes": config.num_classes, "tokens": config.num_patches,
                         **({"stem_widths": list(config.stem_widths)} if config.stem_widths
                            else {"patch_size": config.patch_size}),
                         "distillation_token": config.distillation, "flip_average": config.flip_average},
        "image": {"size": config.image_size, "channels": config.channels, "mode": "L" if config.channels == 1
                  else "RGB", "mean": config.mean, "std": config.std,
                  "preprocessing": "convert to mode, resize (bilinear) to size x size, /255, (x - mean) / std"},
        "labels": list(FASHION_MNIST_LABELS[: config.num_classes]),
    }


EXPORTERS = {"gpt": export_gpt, "translation": export_translation, "vit": export_vit}
