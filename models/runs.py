"""A training run on disk, and how to build one: data + tokenizer + model + task for a (task, configs) pair.

A run folder holds everything export and evaluation need, so nothing is re-derived from code defaults:
  config.json      task, preset, model config, training config
  model.pt         final weights (state_dict)
  checkpoint.pt    weights + optimiser + position, for resuming
  tokenizer.json   text models only, loadable with `tokenizers` alone
  metrics.json     the final evaluation; curves.png and history.json: the training curves
  teacher/         a distilled ViT's teacher (`TrainConfig.teacher`): a run folder of its own, trained first
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn

from models import data, tokenization
from models.config import CHOSEN_AT_EVALUATION, TEACHER_PRESETS, TrainConfig, TranslationConfig, config_from_dict
from models.convnet import ConvNet
from models.gpt import GPT
from models.tasks.gpt import GPTTask
from models.tasks.translation import TranslationTask
from models.tasks.vit import ViTTask
from models.trainer import train
from models.transformer import EncoderDecoderTransformer
from models.vit import ViT

MODEL_CLASSES = {"translation": EncoderDecoderTransformer, "gpt": GPT, "vit": ViT, "teacher": ConvNet}


@dataclass
class Run:
    task_name: str
    model: nn.Module
    task: Any  # TranslationTask | GPTTask | ViTTask
    tokenizer: Tokenizer | None
    data_dir: Path


def build_model(task_name: str, config: Any, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODEL_CLASSES[task_name](config)


def _translation_tokenizer(train_pairs, config: TranslationConfig, train_cfg: TrainConfig, out_dir: Path) -> Tokenizer:
    path = out_dir / "tokenizer.json"
    if path.exists():  # a resumed run keeps the vocabulary its weights were trained with
        return tokenization.load_tokenizer(path)
    pairs = train_pairs[: train_cfg.train_limit] if train_cfg.train_limit else train_pairs
    sentences = [s for pair in pairs for s in pair]
    tokenizer = tokenization.train_translation_tokenizer(sentences, train_cfg.tokenizer_vocab_size or config.vocab_size)
    tokenization.save_tokenizer(tokenizer, path)
    return tokenizer


def prepare_run(task_name: str, config: Any, train_cfg: TrainConfig, data_dir: str | Path | None,
                out_dir: Path, teacher: nn.Module | None = None) -> Run:
    """Load the data, build (or reload) the tokenizer, build the model and the training task (a ViT's with the
    `teacher` it distils from, see `train_teacher`)."""
    root = data.resolve_data_dir(data_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if task_name == "translation":
        train_pairs = data.load_multi30k(root, "train")
        tokenizer = _translation_tokenizer(train_pairs, config, train_cfg, out_dir)
        if tokenizer.get_vocab_size() > config.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} ids, model vocab is {config.vocab_size}")
        task = TranslationTask(config, train_cfg, tokenizer, train_pairs, data.load_multi30k(root, "val"))
    elif task_name == "gpt":
        tokenizer = tokenization.build_byte_tokenizer()
        tokenization.save_tokenizer(tokenizer, out_dir / "tokenizer.json")
        train_text, val_text = data.load_shakespeare(root)
        task = GPTTask(config, train_cfg, _encode_stream(tokenizer, train_text), _encode_stream(tokenizer, val_text))
    elif task_name == "vit":
        tokenizer = None
        task = ViTTask(config, train_cfg, data.load_fashion_mnist(root, "train"), data.load_fashion_mnist(root, "test"),
                       teacher=teacher)
    else:
        raise ValueError(f"unknown task {task_name!r}")
    return Run(task_name, build_model(task_name, config, train_cfg.seed), task, tokenizer, root)


TEACHER_DIR = "teacher"
TEACHER_MODEL = "model.pt"
TEACHER_METRICS = "metrics.json"


def train_teacher(student_cfg: TrainConfig, data_dir: str | Path | None, out_dir: Path,
                  progress: bool = True) -> tuple[ConvNet, dict[str, Any]]:
    """Train (or resume, or reload when finished) the CNN a ViT distils from, in `out_dir`/teacher, on the
    student's training split: the same `train_limit` and `validation_size`, so the validation images stay unseen.
    Returns the teacher in eval mode and its metrics (validation and test accuracy)."""
    config, cfg = TEACHER_PRESETS[student_cfg.teacher]
    if (cfg.train_limit, cfg.validation_size) != (student_cfg.train_limit, student_cfg.validation_size):
        raise ValueError(f"teacher preset {student_cfg.teacher!r} trains on another split than its student "
                         f"(train_limit, validation_size) {cfg.train_limit, cfg.validation_size} vs "
                         f"{student_cfg.train_limit, student_cfg.validation_size}")
    folder = out_dir / TEACHER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    model = build_model("teacher", config, cfg.seed)
    root = data.resolve_data_dir(data_dir)
    task = ViTTask(config, cfg, data.load_fashion_mnist(root, "train"), data.load_fashion_mnist(root, "test"))
    if (folder / TEACHER_MODEL).exists() and (folder / TEACHER_METRICS).exists():
        model.load_state_dict(torch.load(folder / TEACHER_MODEL, map_location="cpu", weights_only=True))
        return model.eval(), json.loads((folder / TEACHER_METRICS).read_text())
    write_config(folder, "teacher", student_cfg.teacher, config, cfg)
    state = train(model, task, cfg, folder, progress=progress)
    metrics = {**task.evaluate(model), "preset": student_cfg.teacher, "parameters": sum(
        p.numel() for p in model.parameters()), "widths": list(config.widths), "epochs_completed": state.epoch,
        "train_seconds": round(state.seconds, 1)}
    torch.save(model.state_dict(), folder / TEACHER_MODEL)
    (folder / TEACHER_METRICS).write_text(json.dumps(metrics, indent=2))
    return model.eval(), metrics


def _encode_stream(tokenizer: Tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text).ids, dtype=np.int64)


def write_config(out_dir: Path, task_name: str, preset: str, config: Any, train_cfg: TrainConfig) -> None:
    payload = {"task": task_name, "preset": preset, "model": asdict(config), "train": asdict(train_cfg)}
    (out_dir / "config.json").write_text(json.dumps(payload, indent=2))


def load_trained(run_dir: str | Path) -> tuple[str, nn.Module, Any, Tokenizer | None, dict]:
    """(task name, model in eval mode, model config, tokenizer or None, the run's config.json) of a run folder; a
    model as its evaluation chose (`models.config.CHOSEN_AT_EVALUATION`: a ViT's `flip_average`)."""
    run_dir = Path(run_dir)
    if run_dir.is_file():
        run_dir = run_dir.parent
    config_path, weights_path = run_dir / "config.json", run_dir / "model.pt"
    for path in (config_path, weights_path):
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: expected a finished run of `python -m models.train`")
    saved = json.loads(config_path.read_text())
    task_name = saved["task"]
    config = config_from_dict(task_name, saved["model"])
    metrics_path = run_dir / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
    chosen = {name: metrics[name] for name in CHOSEN_AT_EVALUATION if name in metrics and hasattr(config, name)}
    config = replace(config, **chosen)  # as models.evaluate chose (a ViT's test-time flip averaging)
    saved["model"].update(chosen)  # the card's architecture shows the model as served
    model = MODEL_CLASSES[task_name](config)
    model.load_state_dict(torch.load(weights_path, map_location="cpu", weights_only=True))
    model.eval()
    tokenizer_path = run_dir / "tokenizer.json"
    tokenizer = tokenization.load_tokenizer(tokenizer_path) if tokenizer_path.exists() else None
    return task_name, model, config, tokenizer, saved

