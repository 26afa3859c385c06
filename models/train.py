"""Command line: train one model from a preset, evaluate it and write a run folder.

    python -m models.train {translation,gpt,vit} --preset {tiny,release} [--data-dir DIR] [--out DIR]

Re-running the same command resumes from the run folder's checkpoint (use --fresh to start over). A ViT preset
with a `teacher` trains that CNN first, in the run folder's teacher/, and distils from it. `--device cuda` trains
the GPT on a GPU (TF32 matrix products, as nanoGPT does); the other tasks train on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from models.config import TASKS, get_preset, with_overrides
from models.curves import plot_history
from models.datasets import DataError
from models.evaluate import evaluate_run
from models.runs import TEACHER_DIR, TEACHER_MODEL, prepare_run, train_teacher, write_config
from models.trainer import CHECKPOINT_NAME, train

DEVICE_TASKS = ("gpt",)  # the tasks whose batches and evaluation follow the model onto a GPU


def training_device(requested: str, task: str) -> torch.device:
    """The device `--device` names: `auto` is a GPU where PyTorch sees one and the task can use it, else the CPU."""
    if requested == "cpu" or (requested == "auto" and (task not in DEVICE_TASKS or not torch.cuda.is_available())):
        return torch.device("cpu")
    if task not in DEVICE_TASKS:
        raise ValueError(f"--device {requested}: only {', '.join(DEVICE_TASKS)} trains on a GPU; {task} trains on "
                         "the CPU")
    if requested != "auto" and not requested.startswith("cuda"):
        raise ValueError(f"--device {requested!r}: choose auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {requested}: this PyTorch sees no CUDA device")
    try:
        return torch.device("cuda" if requested == "auto" else requested)
    except RuntimeError as error:
        raise ValueError(f"--device {requested!r}: {error}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m models.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=TASKS)
    parser.add_argument("--preset", default="tiny", help="named config in models/config.py (tiny, release)")
    parser.add_argument("--data-dir", default=None, help="data folder (default: $TSERVE_DATA_DIR or ../shared/data)")
    parser.add_argument("--out", type=Path, default=None, help="run folder (default: runs/<task>-<preset>)")
    parser.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint and start over")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all cores)")
    parser.add_argument("--device", default="auto",
                        help="cpu, cuda or cuda:N (default auto: a GPU for the GPT where one is present)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        model_cfg, train_cfg = get_preset(args.task, args.preset)
        device = training_device(args.device, args.task)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    train_cfg = with_overrides(train_cfg, epochs=args.epochs, max_steps=args.max_steps, seed=args.seed)
    out_dir = args.out or Path("runs") / f"{args.task}-{args.preset}"
    if args.fresh:
        for name in (CHECKPOINT_NAME, "tokenizer.json", f"{TEACHER_DIR}/{CHECKPOINT_NAME}", f"{TEACHER_DIR}/{TEACHER_MODEL}"):
            (out_dir / name).unlink(missing_ok=True)
    try:
        teacher, teacher_metrics = None, None
        if args.task == "vit" and train_cfg.teacher:
            teacher, teacher_metrics = train_teacher(train_cfg, args.data_dir, out_dir, progress=not args.quiet)
            print(f"teacher {train_cfg.teacher}: {json.dumps(teacher_metrics)}")
        run = prepare_run(args.task, model_cfg, train_cfg, args.data_dir, out_dir, teacher=teacher)
    except DataError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    write_config(out_dir, args.task, args.preset, model_cfg, train_cfg)
    n_params = sum(p.numel() for p in run.model.parameters())
    print(f"{args.task}/{args.preset}: {n_params:,} parameters, {run.task.steps_per_epoch()} steps per epoch, "
          f"writing to {out_dir}")

    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    run.model.to(device)
    state = train(run.model, run.task, train_cfg, out_dir, resume=not args.fresh, progress=not args.quiet)
    run.model.cpu()  # model.pt and the evaluation below: on the CPU, as export and serving read them
    torch.save(run.model.state_dict(), out_dir / "model.pt")
    kept_step = state.best_step if train_cfg.keep_best else None
    plot_history(state.history, out_dir / "curves.png", f"{args.task} ({args.preset})", kept_step)

    started = time.perf_counter()
    metrics = evaluate_run(args.task, run.model, run.task, run.tokenizer, run.data_dir, progress=not args.quiet)
    metrics.update({
        "task": args.task,
        "preset": args.preset,
        "parameters": n_params,
        "steps": state.step,
        "epochs_completed": state.epoch,
        "train_seconds": round(state.seconds, 1),
        "train_device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "eval_seconds": round(time.perf_counter() - started, 1),
        "final_train_loss": round(state.history["train_loss"][-1][1], 4) if state.history["train_loss"] else None,
    })
    if teacher_metrics is not None:
        metrics["teacher"] = teacher_metrics
    if kept_step is not None:
        metrics["kept_step"] = kept_step  # keep_best: the weights evaluated here are from this step
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(json.dumps(metrics, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
