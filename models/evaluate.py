"""Final evaluation of a trained model, and a command line that recomputes it for a saved run.

    python -m models.evaluate RUN_DIR [--data-dir DIR] [--limit N]

Translation: sacreBLEU (cased, default 13a tokenisation) on val and test_2016_flickr, greedy and beam 4, plus the
validation cross-entropy. Beam 4's length penalty is chosen on val (the highest BLEU of `LENGTH_PENALTIES`); the
test set is translated with it, once, and the export makes it the served default. GPT: validation loss (nats per
token) and perplexity. ViT: validation and test accuracy (percent); test-time flip averaging
(`ViTConfig.flip_average`) is chosen on validation (on only if strictly more accurate there), the test set measured
once with the choice, which `models.runs.load_trained` (and so the export) applies.

`--update` merges the recomputed figures into the run's metrics.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import sacrebleu
import torch
from tokenizers import Tokenizer
from torch import nn

from models import data
from models.config import config_from_dict
from models.translate import translate

BLEU_SPLITS = ("val", "test_2016_flickr")
BEAMS = 4
# beam 4's length penalties tried on val; 1.0 (transformers' default) comes first, so it wins a tie
LENGTH_PENALTIES = (1.0, 0.6, 0.8, 1.2, 1.4)


def bleu(hypotheses: list[str], references: list[str]) -> float:
    return round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2)


def evaluate_translation(model: nn.Module, task: Any, tokenizer: Tokenizer, data_dir: Path, limit: int | None,
                         progress: bool = False) -> dict[str, Any]:
    metrics: dict[str, Any] = {"val_loss": round(task.validation_loss(model), 4)}
    splits = {}  # split -> (German sources, English references)
    for split in BLEU_SPLITS:
        pairs = data.load_multi30k(data_dir, split)[:limit]
        splits[split] = [de for de, _ in pairs], [en for _, en in pairs]

    def beam_bleu(split: str, length_penalty: float) -> float:
        sources, references = splits[split]
        return bleu(translate(model, tokenizer, sources, num_beams=BEAMS, length_penalty=length_penalty,
                              progress=progress), references)

    by_penalty = {penalty: beam_bleu("val", penalty) for penalty in LENGTH_PENALTIES}
    chosen = max(LENGTH_PENALTIES, key=by_penalty.__getitem__)  # the first of the best: 1.0 on a tie
    for split, (sources, references) in splits.items():
        metrics[f"bleu_{split}_greedy"] = bleu(translate(model, tokenizer, sources, progress=progress), references)
        metrics[f"bleu_{split}_beam4"] = by_penalty[chosen] if split == "val" else beam_bleu(split, chosen)
        metrics[f"{split}_sentences"] = len(sources)
    metrics["length_penalty"] = chosen
    metrics["val_bleu_beam4_by_length_penalty"] = {str(penalty): value for penalty, value in by_penalty.items()}
    # The names the model card and release targets use.
    metrics["bleu"] = metrics["bleu_test_2016_flickr_beam4"]
    metrics["val_bleu"] = metrics["bleu_val_beam4"]
    return metrics


def evaluate_vit(model: nn.Module, task: Any) -> dict[str, Any]:
    """Validation and test accuracy and loss, with test-time flip averaging chosen on the validation split (a
    run without one keeps its config's setting)."""
    chosen = model.config.flip_average
    by_flip: dict[str, float] = {}
    if task.held_out:
        for flip in (False, True):
            model.config = replace(model.config, flip_average=flip)
            by_flip[str(flip).lower()] = task.validation_accuracy(model)
        chosen = by_flip["true"] > by_flip["false"]  # off on a tie: it doubles the compute
    model.config = replace(model.config, flip_average=chosen)
    metrics = task.evaluate(model)
    metrics["flip_average"] = chosen
    if by_flip:
        metrics["val_accuracy_by_flip_average"] = by_flip
    return metrics


def evaluate_run(task_name: str, model: nn.Module, task: Any, tokenizer: Tokenizer | None, data_dir: Path,
                 limit: int | None = None, progress: bool = False) -> dict[str, Any]:
    model.eval()
    with torch.no_grad():
        if task_name == "translation":
            return evaluate_translation(model, task, tokenizer, data_dir,
                                        limit if limit is not None else task.train_cfg.eval_limit, progress)
        if task_name == "vit":
            return evaluate_vit(model, task)
        return task.evaluate(model)


def main(argv: list[str] | None = None) -> int:
    from models.runs import prepare_run

    parser = argparse.ArgumentParser(prog="python -m models.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run folder written by python -m models.train")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--limit", type=int, default=None, help="evaluate on the first N examples of each split")
    parser.add_argument("--update", action="store_true", help="merge the figures into the run's metrics.json")
    args = parser.parse_args(argv)
    try:
        saved = json.loads((args.run_dir / "config.json").read_text())
        weights = torch.load(args.run_dir / "model.pt", map_location="cpu", weights_only=True)
    except FileNotFoundError as error:
        print(f"error: {error.filename} not found: expected a finished run of `python -m models.train`",
              file=sys.stderr)
        return 2
    from models.config import TrainConfig

    train_cfg = TrainConfig(**{k: tuple(v) if k == "betas" else v for k, v in saved["train"].items()})
    train_cfg = replace(train_cfg, eval_limit=args.limit)
    config = config_from_dict(saved["task"], saved["model"])
    try:
        run = prepare_run(saved["task"], config, train_cfg, args.data_dir, args.run_dir)
    except data.DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    run.model.load_state_dict(weights)
    metrics = evaluate_run(run.task_name, run.model, run.task, run.tokenizer, run.data_dir, args.limit)
    print(json.dumps(metrics, indent=2))
    if args.update:
        path = args.run_dir / "metrics.json"
        previous = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**previous, **metrics}, indent=2))
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
