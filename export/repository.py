"""Write one model version into the repository: graphs, tokenizer, config.json and the model card.

The version folder is built in a temporary sibling and renamed into place only after every parity check has
passed, so a serving process never sees a half-written or unchecked version.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from export import checks
from export.compress import store_weights_as_fp16
from export.onnx_export import EXPORTERS, OPSET
from models import data
from service.decoding import GreedySearch
from service.repository import CONFIG_FILE, TOKENIZER_FILE, ModelRepository, ModelVersion

DATA_NOTES = {
    "translation": "Multi30k task 1 (de-en): 29,000 training pairs; BLEU on test_2016_flickr (1,000) and val (1,014).",
    "gpt": "tinyshakespeare: first 90% of the 1,115,394 characters for training, last 10% for validation.",
    "vit": "Fashion-MNIST: 60,000 training images, 10,000 test images, 28x28 grey, 10 classes.",
}


def _engine_and_inputs(kind: str, version: ModelVersion, tokenizer, data_dir) -> tuple[Any, dict[str, Any]]:
    """The ONNX Runtime engine of a version folder and the real validation inputs the checks use."""
    from service.engines.gpt import GPTEngine
    from service.engines.translation import TranslationEngine
    from service.engines.vit import ViTEngine

    root = data.resolve_data_dir(data_dir)
    if kind == "gpt":
        _, val_text = data.load_shakespeare(root)
        engine = GPTEngine(version)
        max_new_tokens = min(24, engine.context_length // 4)
        room = engine.context_length - max_new_tokens - 4  # longest prompt that leaves room to generate
        starts = np.linspace(0, len(val_text) - engine.context_length, 50).astype(int)
        prompts = [tokenizer.encode(val_text[s : s + 4 + (i * 7) % room]).ids for i, s in enumerate(starts)]
        return engine, {"prompts": prompts, "max_new_tokens": max_new_tokens}
    if kind == "translation":
        engine = TranslationEngine(version)
        pairs = data.load_multi30k(root, "val")[:50]
        return engine, {"sources": [engine.source_ids(de) for de, _ in pairs],
                        "targets": [tokenizer.encode(en).ids for _, en in pairs]}
    images, _ = data.load_fashion_mnist(root, "test")
    return ViTEngine(version), {"images": images[:1000]}


def _parity(kind: str, model, version: ModelVersion, tokenizer, data_dir) -> dict[str, Any]:
    engine, inputs = _engine_and_inputs(kind, version, tokenizer, data_dir)
    return {"gpt": checks.check_gpt, "translation": checks.check_translation, "vit": checks.check_vit}[kind](
        model, engine, **inputs)


def _served_quality(kind: str, version: ModelVersion, tokenizer, metrics: dict, data_dir) -> dict[str, Any]:
    """The exported graph's own figure next to the PyTorch one, on the data the card was measured on (GPT: val
    loss over the card's `val_tokens`; ViT: accuracy over its `test_images`). Translation BLEU through the
    server is `export.verify_served`'s job (it needs beam search and batching, i.e. the service)."""
    from service.engines.gpt import GPTEngine
    from service.engines.vit import ViTEngine

    root = data.resolve_data_dir(data_dir)
    if kind == "gpt" and "val_loss" in metrics:
        _, val_text = data.load_shakespeare(root)
        ids = np.asarray(tokenizer.encode(val_text).ids, dtype=np.int64)[: metrics.get("val_tokens")]
        served = checks.gpt_validation_loss(GPTEngine(version), ids)
        return {"onnx_val_loss": round(served, 4),
                "onnx_val_loss_minus_pytorch": round(served - metrics["val_loss"], 4) + 0.0}  # + 0.0: no "-0.0"
    if kind == "vit" and "test_accuracy" in metrics:
        images, labels = data.load_fashion_mnist(root, "test")
        count = metrics.get("test_images", len(labels))
        served = checks.vit_test_accuracy(ViTEngine(version), images[:count], labels[:count])
        return {"onnx_test_accuracy": round(served, 2),
                "onnx_test_accuracy_minus_pytorch": round(served - metrics["test_accuracy"], 2) + 0.0}
    return {}


def _greedy_outputs(kind: str, version: ModelVersion, tokenizer, data_dir) -> list:
    """Greedy tokens (text models) or argmax labels (ViT) of the check inputs, from the ONNX Runtime engine."""
    engine, inputs = _engine_and_inputs(kind, version, tokenizer, data_dir)
    if kind == "vit":
        return [row[0][1] for row in engine.classify([Image.fromarray(i) for i in inputs["images"]], top_k=1)]
    if kind == "gpt":
        searches = engine.generate(inputs["prompts"], lambda _: GreedySearch(inputs["max_new_tokens"], engine.eos_id))
    else:
        sources = inputs["sources"]
        searches = engine.translate_ids(sources, lambda i: GreedySearch(
            engine.default_max_new_tokens(len(sources[i])), engine.eos_id))
    return [s.results()[0].tokens for s in searches]


def _model_card(name: str, version: int, config: dict, metrics: dict, run_config: dict, run_dir: Path) -> str:
    data = DATA_NOTES[config["kind"]]
    train_limit = run_config.get("train", {}).get("train_limit")
    if train_limit:  # the tiny presets: the first examples only (the test fixtures, tests/fixtures)
        data += f" This run trained on the first {train_limit:,} training examples only."
    lines = [f"# {name} version {version}", "", f"Kind: `{config['kind']}`. Data: {data}", ""]
    lines += ["## Training", "", f"Command: `python -m models.train {run_config['task']} --preset "
              f"{run_config['preset']}` (run folder `{run_dir.name}`)", ""]
    for key in ("parameters", "steps", "epochs_completed", "train_seconds"):
        if key in metrics:
            lines.append(f"- {key.replace('_', ' ')}: {metrics[key]:,}" if isinstance(metrics[key], int)
                         else f"- {key.replace('_', ' ')}: {metrics[key]}")
    if "kept_step" in metrics:
        lines.append(f"- kept weights: step {metrics['kept_step']:,}, the evaluation with the lowest validation "
                     "loss (`keep_best`); the metrics below are those weights'")
    if "weights_storage" in config:
        lines.append(f"- weights stored as {config['weights_storage']}")
    lines += ["", "## Metrics", "", "| metric | value |", "| --- | --- |"]
    for key, value in metrics.items():
        if key not in ("export_checks", "task", "preset") and isinstance(value, (int, float)):
            lines.append(f"| {key} | {value} |")
    lines += ["", "## Export checks (ONNX Runtime vs PyTorch)", "", "| check | result |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in metrics.get("export_checks", {}).items()]
    lines += ["", "## Architecture", "", "```json", json.dumps(run_config["model"], indent=2), "```", ""]
    if (run_dir / "curves.png").exists():
        lines += ["## Training curves", "", "![training curves](curves.png)", ""]
    return "\n".join(lines)


def export_run(kind: str, run_dir: Path, repository: Path, name: str | None = None, version: int | None = None,
               data_dir: str | None = None, weights: str = "fp32") -> Path:
    """Export, check, and (weights="fp16") store the weights as float16, recording the agreement with float32."""
    from models.runs import load_trained

    task, model, model_config, tokenizer, run_config = load_trained(run_dir)
    if task != kind:
        raise ValueError(f"{run_dir} holds a {task} model, not {kind}")
    run_dir = Path(run_dir) if Path(run_dir).is_dir() else Path(run_dir).parent
    name = name or kind
    repo = ModelRepository(repository)
    version = version or repo.next_version(name)
    final = repository / name / str(version)
    if final.exists():
        raise ValueError(f"{final} already exists; pick another --version")
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=final.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; servers may run as another user
    try:
        config = EXPORTERS[kind](model, model_config, staging)
        config.update({"name": name, "version": version, "opset": OPSET,
                       "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        if tokenizer is not None:
            shutil.copy(run_dir / TOKENIZER_FILE, staging / TOKENIZER_FILE)
            config["tokenizer"] = TOKENIZER_FILE
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        metrics_path = run_dir / "metrics.json"
        metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
        staged = ModelVersion(name, version, staging, config)
        metrics["export_checks"] = _parity(kind, model, staged, tokenizer, data_dir)
        if weights == "fp16":
            reference = _greedy_outputs(kind, staged, tokenizer, data_dir)
            for file in config["files"].values():
                store_weights_as_fp16(staging / file)
            compressed = _greedy_outputs(kind, staged, tokenizer, data_dir)
            same = sum(a == b for a, b in zip(reference, compressed))
            output = "argmax" if kind == "vit" else "greedy_output"
            metrics["export_checks"][f"fp16_weights_same_{output}_as_fp32"] = f"{same}/{len(reference)}"
            config["weights_storage"] = "float16, cast to float32 when the session loads"
            (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        metrics["export_checks"].update(_served_quality(kind, staged, tokenizer, metrics, data_dir))
        (staging / "metrics.json").write_text(json.dumps(metrics, indent=2))
        if (run_dir / "curves.png").exists():
            shutil.copy(run_dir / "curves.png", staging / "curves.png")
        (staging / "README.md").write_text(_model_card(name, version, config, metrics, run_config, run_dir))
        staging.rename(final)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return final
