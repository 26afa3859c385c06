"""Write one model version into the repository: graphs, tokenizer, config.json and the model card.

The version folder is built in a temporary sibling and renamed into place only after every parity check has
passed, so a serving process never sees a half-written or unchecked version.

Graph variants (`rewrite_graphs`, shared with `export.convert`): weights stored as fp32, fp16 (`export.compress`)
or int8 (`export.quantize`), attention as exported ("plain") or fused into contrib MultiHeadAttention ("mha",
`export.attention_fusion`). A variant other than fp32/plain must stay within `export.tolerances` of the float32 model's
quality on the card's data (`check_quality`), int8 and mha included; fp16 records its figures only.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from tokenizers import Tokenizer

from export import checks
from export.compress import store_weights_as_fp16
from export.onnx_export import EXPORTERS, OPSET
from export.quantize import quantize_int8
from export.tolerances import TOLERANCES, quality_tolerance, within
from models import data
from service.decoding import GreedySearch
from service.engines.weights import changes_step_attention
from service.repository import CONFIG_FILE, TOKENIZER_FILE, ModelRepository, ModelVersion

DATA_NOTES = {
    "translation": "Multi30k task 1 (de-en): 29,000 training pairs; BLEU on test_2016_flickr (1,000) and val (1,014).",
    "gpt": "tinyshakespeare: first 90% of the 1,115,394 characters for training, last 10% for validation.",
    "vit": "Fashion-MNIST: 60,000 training images, 10,000 test images, 28x28 grey, 10 classes.",
}


WEIGHTS = ("fp32", "fp16", "int8")
ATTENTION = ("plain", "mha")
KV_CACHE = ("concat", "inplace")  # inplace: a step graph writing the new slot into fixed buffers (export.kv_inplace)
KV_INPLACE_NOTE = ("decoding steps run an in-place step graph (`decoder_step.onnx`, `export.kv_inplace`): the "
                   "KV cache is fixed-capacity buffers written in place, not a copy of the past every step")
WEIGHT_STORAGE = {
    "fp16": "float16, cast to float32 when the session loads",
    "int8": "MatMul weights int8 (ONNX Runtime MatMulNBits: 8-bit symmetric blocks of 32, one scale each; int8 "
            "activations per row); the other large weights float16, cast to float32 when the session loads",
}
# The card's figure of each kind; how far a graph variant may move it is `export.tolerances`.
QUALITY_METRIC = {"gpt": "val_loss", "translation": "bleu", "vit": "test_accuracy"}
QUALITY_DATA = {"val_loss": "tinyshakespeare validation tokens ({} of them)",
                "bleu": "sacreBLEU (cased, 13a), beam 4, through the service, Multi30k test_2016_flickr ({} sentences)",
                "test_accuracy": "Fashion-MNIST test images ({} of them)"}


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


# The card's name for the exported graph's own quality figure, and its decimal places.
SERVED_FIGURE = {"gpt": ("onnx_val_loss", 4), "vit": ("onnx_test_accuracy", 2), "translation": ("served_bleu", 2)}


def _served_quality(kind: str, version: ModelVersion, tokenizer, metrics: dict, data_dir,
                    checked: dict[str, Any] | None = None) -> dict[str, Any]:
    """The exported graph's own figure next to the PyTorch one, on the data the card was measured on (GPT: val
    loss over the card's `val_tokens`; ViT: accuracy over its `test_images`; translation: BLEU through the
    service). `checked`, a `check_quality` result for this graph, is used as it is rather than measured again.
    Without one, translation BLEU is `export.verify_served`'s job (it needs beam search and batching, i.e. the
    service)."""
    metric = QUALITY_METRIC[kind]
    if metric not in metrics or (checked is None and kind == "translation"):
        return {}
    served = checked["measured"] if checked is not None else measure_quality(kind, version, tokenizer, metrics,
                                                                             data_dir)
    name, places = SERVED_FIGURE[kind]
    return {name: served, f"{name}_minus_pytorch": round(served - metrics[metric], places) + 0.0}  # no "-0.0"


def version_tokenizer(version: ModelVersion) -> Tokenizer | None:
    """The tokenizer a repository version's config.json names, or None (the ViT has none)."""
    name = version.config.get("tokenizer")
    return Tokenizer.from_file(str(version.path / name)) if name else None


def _quality_count(kind: str, card: dict) -> int | None:
    """How many tokens / sentences / images the card's figure was measured on (None: the whole split)."""
    return card.get({"gpt": "val_tokens", "translation": "test_2016_flickr_sentences", "vit": "test_images"}[kind])


@contextlib.contextmanager
def _translation_service(version: ModelVersion, weights: str | None = None) -> Iterator[str]:
    """URL of `python -m service` serving this one version folder (as `translation`, the name the BLEU check asks
    for), from a temporary repository that links to it, in the `weights` variant (None: as stored)."""
    from service.client.launcher import ServiceProcess

    with tempfile.TemporaryDirectory(prefix="quality-") as scratch:
        (Path(scratch) / "translation").mkdir()
        (Path(scratch) / "translation" / str(version.version)).symlink_to(version.path.resolve())
        with ServiceProcess("quality", scratch, models='["translation"]', log_level="WARNING", drain_delay_s=0,
                            variant=f"translation={weights}" if weights else "stored") as server:
            yield server.url


def measure_quality(kind: str, version: ModelVersion, tokenizer, card: dict, data_dir,
                    weights: str | None = None) -> float:
    """The graph's figure on the data `card` was measured on: GPT validation loss (nats, 4 places), ViT test accuracy
    (percent, 2 places), translation BLEU through the service as `export.verify_served` measures it; in the
    `weights` variant (`service.engines.weights`, derived as the service derives it; None: as stored)."""
    from service.engines.gpt import GPTEngine
    from service.engines.runtime import RuntimeOptions
    from service.engines.vit import ViTEngine

    options = RuntimeOptions(weights=weights)

    root = data.resolve_data_dir(data_dir)
    count = _quality_count(kind, card)
    if kind == "gpt":
        _, val_text = data.load_shakespeare(root)
        ids = np.asarray(tokenizer.encode(val_text).ids, dtype=np.int64)[:count]
        if changes_step_attention(weights):  # the step graph's attention changed: scored through the steps
            return round(checks.gpt_step_validation_loss(GPTEngine(version, options), ids), 4)
        return round(checks.gpt_validation_loss(GPTEngine(version, options), ids), 4)
    if kind == "vit":
        images, labels = data.load_fashion_mnist(root, "test")
        return round(checks.vit_test_accuracy(ViTEngine(version, options), images[:count], labels[:count]), 2)
    from export.verify_served import verify_translation

    with _translation_service(version, weights) as url:
        return verify_translation(url, card, root)["served"]


def check_quality(kind: str, version: ModelVersion, tokenizer, card: dict, data_dir,
                  tolerances: dict[str, float] = TOLERANCES, weights: str | None = None) -> dict[str, Any]:
    """Measure the graph (in the `weights` variant: `measure_quality`) on the card's data and compare with the
    card's float32 figure; raises `checks.ExportCheckError` outside the tolerance, else returns what was measured."""
    metric = QUALITY_METRIC[kind]
    measured = measure_quality(kind, version, tokenizer, card, data_dir, weights)
    reference = card[metric]
    delta = round(measured - reference, 4) + 0.0
    count = _quality_count(kind, card)
    if count is None and metric == "test_accuracy":  # a card without its count: the whole test split
        count = len(data.load_fashion_mnist(data.resolve_data_dir(data_dir), "test")[1])
    tolerance = quality_tolerance(metric, reference, count or 0, tolerances)
    described = QUALITY_DATA[metric].format(f"{count:,}" if count else "all")
    if kind == "gpt" and changes_step_attention(weights):
        described += ", scored through the decoding steps"  # `measure_quality`
    result = {"metric": metric, "data": described,
              "measured": measured, "reference": reference, "delta": delta, "tolerance": tolerance}
    if not within(metric, delta, tolerance):
        raise checks.ExportCheckError(f"{version.name}: {metric} {measured} vs {reference} (delta {delta}) is "
                                      f"outside the tolerance {tolerance}; nothing written")
    return result


def rewrite_graphs(folder: Path, config: dict, weights: str = "fp32", attention: str = "plain",
                   kv_cache: str = "concat") -> dict[str, Any]:
    """Rewrite the version folder's graphs in place: attention fusion first (mha), then the weight storage (fp16 or
    int8), then (kv_cache "inplace") the decoder's in-place step graph beside it (`export.kv_inplace`); records
    the variant in `config` and returns what was done (fused nodes, file sizes, rewritten layers)."""
    if weights not in WEIGHTS or attention not in ATTENTION or kv_cache not in KV_CACHE:
        raise ValueError(f"weights must be one of {WEIGHTS}, attention one of {ATTENTION} and kv_cache one of "
                         f"{KV_CACHE}")
    done: dict[str, Any] = {}
    for file in config["files"].values():
        path = folder / file
        before = path.stat().st_size
        if attention == "mha":
            from export.attention_fusion import fuse_attention

            done[f"{file}_fused_attention_nodes"] = fuse_attention(path)
        if weights == "fp16":
            store_weights_as_fp16(path)
        elif weights == "int8":
            quantize_int8(path)
        done[f"{file}_bytes"] = f"{before:,} -> {path.stat().st_size:,}"
    if kv_cache == "inplace":
        from export.kv_inplace import add_step_graph

        done["decoder_step_layers"] = add_step_graph(folder, config)
    config.update({"weights": weights, "attention": attention, "kv_cache": kv_cache})
    if weights in WEIGHT_STORAGE:
        config["weights_storage"] = WEIGHT_STORAGE[weights]
    return done


def variant_label(weights: str, attention: str, kv_cache: str = "concat") -> str:
    """The variant's name in the card's check names: int8_weights, fp32_weights_mha_attention, ..."""
    return (f"{weights}_weights" + ("_mha_attention" if attention == "mha" else "")
            + ("_inplace_kv_cache" if kv_cache == "inplace" else ""))


def _describe_check(quality: dict[str, Any]) -> str:
    return (f"{quality['measured']} vs {quality['reference']} (delta {quality['delta']:+}, tolerance "
            f"{quality['tolerance']}) on {quality['data']}")


def same_outputs(reference: list, outputs: list) -> str:
    """How many greedy outputs (or argmax labels) agree, as "n/N"."""
    return f"{sum(a == b for a, b in zip(reference, outputs))}/{len(reference)}"


def greedy_outputs(kind: str, version: ModelVersion, tokenizer, data_dir) -> list:
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
    training = run_config.get("train", {})
    train_limit = training.get("train_limit")
    if train_limit:  # the tiny presets: the first examples only (the test fixtures, tests/fixtures)
        data += f" This run trained on the first {train_limit:,} training examples only."
    held_out = training.get("validation_size")
    if held_out:  # the ViT: choices on a validation split, the test set measured once
        choices = "the kept epoch" + (", test-time flip averaging" if "flip_average" in metrics else "")
        data += (f" The last {held_out:,} of those training images were held out as the validation split: every "
                 f"choice ({choices}) was made on them, and the test set was measured once, at the end.")
    lines = [f"# {name} version {version}", "", f"Kind: `{config['kind']}`. Data: {data}", ""]
    command = f"python -m models.train {run_config['task']} --preset {run_config['preset']}"
    device = metrics.get("train_device", "cpu")  # models.train --device: where the steps ran
    if device != "cpu":
        command += " --device cuda"
    lines += ["## Training", "", f"Command: `{command}` (run folder `{run_dir.name}`)", ""]
    if device != "cpu":
        lines.append(f"- trained on: {device} (evaluated on the CPU)")
    for key in ("parameters", "steps", "epochs_completed", "train_seconds"):
        if key in metrics:
            lines.append(f"- {key.replace('_', ' ')}: {metrics[key]:,}" if isinstance(metrics[key], int)
                         else f"- {key.replace('_', ' ')}: {metrics[key]}")
    ema_decay = training.get("ema_decay")
    if ema_decay:
        lines.append(f"- weights: the exponential moving average of the training weights (decay {ema_decay}, "
                     "updated every step), which is also what the validation curve measured")
    average_last = training.get("average_last")
    if average_last:
        lines.append(f"- weights: the mean of the weights at the last {average_last} evaluations (`average_last`, "
                     "Vaswani et al.'s checkpoint averaging)")
    if "kept_step" in metrics:
        lines.append(f"- kept weights: step {metrics['kept_step']:,}, the evaluation with the lowest validation "
                     "loss (`keep_best`); the metrics below are those weights'")
    teacher = metrics.get("teacher")
    if teacher:  # a distilled ViT (DeiT): models.runs.train_teacher
        lines.append(f"- distilled from a CNN teacher (DeiT's hard distillation: a distillation token whose head "
                     f"learns the teacher's labels; the served logits are the mean of its head and [CLS]'s): "
                     f"`models/convnet.py`, preset `{teacher['preset']}`, widths {teacher['widths']}, "
                     f"{teacher['parameters']:,} parameters, {teacher['epochs_completed']} epochs on the same "
                     f"training split; validation accuracy {teacher['val_accuracy']}%, test accuracy "
                     f"{teacher['test_accuracy']}%")
    by_flip = metrics.get("val_accuracy_by_flip_average")
    if metrics.get("flip_average"):  # a ViT: models.evaluate chose test-time flip averaging on validation
        lines.append("- test-time flip averaging: the logits are the mean of the image's and its mirror image's (one "
                     "batch of twice the images through the graph), chosen on the validation split"
                     + (f" ({by_flip['true']}% with it, {by_flip['false']}% without)" if by_flip else ""))
    if "weights_storage" in config:
        lines.append(f"- weights stored as {config['weights_storage']}")
    if config.get("attention") == "mha":
        lines.append("- attention fused into ONNX Runtime's contrib MultiHeadAttention (`--attention mha`)")
    if config.get("kv_cache") == "inplace":
        lines.append(f"- {KV_INPLACE_NOTE} (`--kv-cache inplace`)")
    lines += ["", "## Metrics", "", "| metric | value |", "| --- | --- |"]
    for key, value in metrics.items():
        if key not in ("export_checks", "task", "preset") and isinstance(value, (int, float)):
            lines.append(f"| {key} | {value} |")
    lines += ["", "## Export checks (ONNX Runtime vs PyTorch)", "", "| check | result |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in metrics.get("export_checks", {}).items()]
    architecture = dict(run_config["model"])
    if architecture.get("stem_widths"):  # a ViT whose convolutional stem replaces the patch convolution
        architecture.pop("patch_size", None)
    lines += ["", "## Architecture", "", "```json", json.dumps(architecture, indent=2), "```", ""]
    if (run_dir / "curves.png").exists():
        lines += ["## Training curves", "", "![training curves](curves.png)", ""]
    return "\n".join(lines)


def export_run(kind: str, run_dir: Path, repository: Path, name: str | None = None, version: int | None = None,
               data_dir: str | None = None, weights: str = "fp32", attention: str = "plain",
               kv_cache: str = "concat") -> Path:
    """Export and check; a variant (`rewrite_graphs`) records its agreement with the float32 graph, and int8 or
    mha must keep the quality within `TOLERANCES` of the PyTorch model's figure on the card's data."""
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
        metrics_path = run_dir / "metrics.json"
        metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
        if "length_penalty" in metrics:  # chosen on validation by models.evaluate: the served default
            config["generation"] = {"length_penalty": metrics["length_penalty"]}
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        staged = ModelVersion(name, version, staging, config)
        metrics["export_checks"] = _parity(kind, model, staged, tokenizer, data_dir)
        quality = None  # a variant's check against the PyTorch figure, when it has one
        if (weights, attention, kv_cache) != ("fp32", "plain", "concat"):
            reference = greedy_outputs(kind, staged, tokenizer, data_dir)
            metrics["export_checks"].update(rewrite_graphs(staging, config, weights, attention, kv_cache))
            output = "argmax" if kind == "vit" else "greedy_output"
            label = variant_label(weights, attention, kv_cache)
            metrics["export_checks"][f"{label}_same_{output}_as_fp32"] = same_outputs(
                reference, greedy_outputs(kind, staged, tokenizer, data_dir))
            if (weights, attention, kv_cache) != ("fp16", "plain", "concat"):  # fp16 storage: not held to them
                quality = check_quality(kind, staged, tokenizer, metrics, data_dir)
                metrics["export_checks"][f"{quality['metric']}_within_tolerance"] = _describe_check(quality)
        else:
            config.update({"weights": weights, "attention": attention, "kv_cache": kv_cache})
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        metrics["export_checks"].update(_served_quality(kind, staged, tokenizer, metrics, data_dir, quality))
        (staging / "metrics.json").write_text(json.dumps(metrics, indent=2))
        if (run_dir / "curves.png").exists():
            shutil.copy(run_dir / "curves.png", staging / "curves.png")
        (staging / "README.md").write_text(_model_card(name, version, config, metrics, run_config, run_dir))
        staging.rename(final)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return final
