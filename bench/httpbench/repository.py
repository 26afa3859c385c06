"""The benchmark's model repository: gpt/1, translation/1 and vit/1 at the release presets' sizes with random
weights (seed 0), exported with the project's exporter and rewritten into the graph variant the release models are
served in (bench/shipped.py: int8 weights, fused attention, ...), built once per source digest; `random_model` is
the model of one kind as exported, which the C++ peers convert (bench/httpbench/llama_server.py, ct2_offline.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

from . import PROJECT_ROOT

TRANSLATION_TOKENIZER_PAIRS = 5000  # Multi30k training pairs the benchmark's BPE is trained on
PRESET = "release"  # the models' sizes
SEED = 0  # torch's seed before each model is built: its random weights


def _source_digest(extra: dict) -> str:
    sources = sorted(PROJECT_ROOT.glob("models/*.py")) + sorted(PROJECT_ROOT.glob("export/*.py"))
    digest = hashlib.sha1(json.dumps(extra, sort_keys=True).encode())
    for path in sources:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def random_model(kind: str):
    """The repository's model of `kind` ("gpt", "translation", "vit") in PyTorch, as `build_repository` exports it:
    the release preset's size, no dropout, the shipped model's evaluation-time choices (`shipped_choices`), random
    weights (seed 0); its config is `model.config`."""
    import dataclasses

    import torch
    from shipped import shipped_choices

    from models.config import get_preset
    from models.gpt import GPT
    from models.transformer import EncoderDecoderTransformer
    from models.vit import ViT

    builders = {"gpt": GPT, "translation": EncoderDecoderTransformer, "vit": ViT}
    config = dataclasses.replace(get_preset(kind, PRESET)[0], dropout=0.0, **shipped_choices(kind))
    torch.manual_seed(SEED)
    return builders[kind](config).eval()


def build_repository(workdir: Path, data_dir: Path, threads: int) -> Path:
    """A repository with gpt/1, translation/1 and vit/1 (release sizes, random weights, the shipped graph variant),
    built once per source digest into workdir/repository-<digest>; built in a staging folder and renamed into place
    when complete."""
    from shipped import shipped_choices, shipped_variant

    from models.config import get_preset

    presets = {kind: get_preset(kind, PRESET)[0] for kind in ("gpt", "translation", "vit")}
    variants = {kind: shipped_variant(kind) for kind in presets}
    choices = {kind: shipped_choices(kind) for kind in presets}
    key = _source_digest({"presets": {k: repr(v) for k, v in presets.items()}, "seed": SEED,
                          "tokenizer_pairs": TRANSLATION_TOKENIZER_PAIRS, "variants": variants, "choices": choices})
    final = workdir / f"repository-{key}"
    if final.is_dir():
        return final
    print(f"building the random-weight model repository in {final} (once) ...", flush=True)
    started = time.perf_counter()
    import torch

    from export.kv_scales import calibration_peaks, save_scales
    from export.onnx_export import EXPORTERS, OPSET
    from export.repository import rewrite_graphs
    from models import data
    from models.tokenization import build_byte_tokenizer, train_translation_tokenizer
    from service.repository import CONFIG_FILE, TOKENIZER_FILE, ModelVersion

    torch.set_num_threads(threads)
    workdir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".repository-", dir=workdir))
    try:
        for kind in presets:
            folder = staging / kind / "1"
            folder.mkdir(parents=True)
            model = random_model(kind)
            config = model.config
            described = EXPORTERS[kind](model, config, folder)
            described.update({"name": kind, "version": 1, "opset": OPSET,
                              "note": "random weights, built by bench/bench_http.py"})
            if kind == "gpt":
                build_byte_tokenizer().save(str(folder / TOKENIZER_FILE))
            elif kind == "translation":
                pairs = data.load_multi30k(data_dir, "train")[:TRANSLATION_TOKENIZER_PAIRS]
                tokenizer = train_translation_tokenizer([s for pair in pairs for s in pair], config.vocab_size)
                tokenizer.save(str(folder / TOKENIZER_FILE))
            if kind != "vit":
                described["tokenizer"] = TOKENIZER_FILE
            if variants[kind]:
                rewrite_graphs(folder, described, **variants[kind])
            (folder / CONFIG_FILE).write_text(json.dumps(described, indent=2))
            if "decoder_step" in described["files"]:  # the int8 KV cache's scales (`+gqa+kv8`), as the release has
                version = ModelVersion(kind, 1, folder, described)
                save_scales(version, calibration_peaks(version, None), "random tokens only (random weights)")
            print(f"  exported {kind} ({sum(p.stat().st_size for p in folder.iterdir()) / 1e6:.1f} MB)", flush=True)
        staging.rename(final)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    print(f"  built in {time.perf_counter() - started:.0f} s", flush=True)
    return final

