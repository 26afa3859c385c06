"""The training loop shared by the three models: AdamW, warmup then decay, clipping, checkpoints with resume.

Follows nanoGPT's `train.py` in spirit (one loop, a learning-rate function, periodic evaluation and checkpoints)
with the task-specific parts behind a small `TrainingTask` protocol: batches for an epoch, a loss for a batch,
and a validation loss for the curve. Everything a resumed run needs (weights, optimiser, position in the epoch,
RNG state, history) is in one checkpoint file, written atomically. With `keep_best` the weights of the
evaluation with the lowest validation loss are kept in `best.pt` and restored at the end (nanoGPT keeps its
best-validation checkpoint the same way). With `ema_decay` an exponential moving average of the weights
(`torch.optim.swa_utils`, updated every step) is what is evaluated, kept and returned: the continuous form of
averaging the last checkpoints (Vaswani et al.). With `average_last` N, the weights at each of the last N
evaluations are kept in `snapshots/` and their mean is the model returned (its validation loss the last point of
the curve, `averaged_val_loss`), as Vaswani et al. average their last 5 checkpoints.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from tqdm import tqdm

from models.config import TrainConfig

CHECKPOINT_NAME = "checkpoint.pt"
BEST_NAME = "best.pt"
SNAPSHOT_DIR = "snapshots"  # average_last: the weights at each evaluation, the last N kept


class TrainingTask(Protocol):
    def steps_per_epoch(self) -> int: ...

    def batches(self, epoch: int) -> Iterator[Any]:
        """The batches of one epoch, in an order fixed by (seed, epoch) so that a resumed run sees the same."""

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        """Mean training loss of a batch and how many units (tokens or images) it covered."""

    def validation_loss(self, model: nn.Module) -> float: ...


@dataclass
class TrainState:
    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # batches of `epoch` already consumed
    seconds: float = 0.0  # training wall time so far, across resumes
    history: dict[str, list[list[float]]] = field(default_factory=lambda: {"train_loss": [], "val_loss": []})
    best_val_loss: float | None = None  # keep_best: the lowest validation loss so far and its step
    best_step: int | None = None


def total_steps(cfg: TrainConfig, steps_per_epoch: int) -> int:
    steps = cfg.epochs * steps_per_epoch
    return min(steps, cfg.max_steps) if cfg.max_steps is not None else steps


def lr_factor(step: int, cfg: TrainConfig, total: int) -> float:
    """Linear warmup to the peak, then inverse square root (Vaswani et al.) or cosine to `min_lr_ratio`."""
    step = step + 1
    warmup = max(cfg.warmup_steps, 1)
    if step <= warmup:
        return step / warmup
    if cfg.schedule == "inverse_sqrt":
        return math.sqrt(warmup / step)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, LayerNorms or position/class tokens)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def _save_atomically(obj: Any, path: Path) -> None:
    """torch.save into a sibling temporary file, then rename: a reader never sees a half-written file."""
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def _save_checkpoint(path: Path, model, optimizer, state: TrainState, average: AveragedModel | None) -> None:
    _save_atomically({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "state": asdict(state),
                      "rng": torch.get_rng_state(),
                      "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
                      "average": average.state_dict() if average is not None else None}, path)


def weight_average(model: nn.Module, cfg: TrainConfig) -> AveragedModel | None:
    """The moving average of `model`'s parameters that `cfg.ema_decay` asks for, or None."""
    if cfg.ema_decay is None:
        return None
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(cfg.ema_decay))


def _snapshot(model: nn.Module, out_dir: Path, step: int, keep: int) -> None:
    """Write the weights at `step` into snapshots/ and delete all but the newest `keep`."""
    folder = out_dir / SNAPSHOT_DIR
    folder.mkdir(exist_ok=True)
    _save_atomically(model.state_dict(), folder / f"step-{step:08d}.pt")
    for old in sorted(folder.glob("step-*.pt"))[:-keep]:
        old.unlink()


def average_snapshots(out_dir: Path, last: int) -> dict[str, torch.Tensor]:
    """The mean of the newest `last` snapshots' weights (floating tensors averaged in float64, others taken from
    the newest); ValueError when there are none."""
    paths = sorted((out_dir / SNAPSHOT_DIR).glob("step-*.pt"))[-last:]
    if not paths:
        raise ValueError(f"no weight snapshots in {out_dir / SNAPSHOT_DIR} to average")
    states = [torch.load(path, map_location="cpu", weights_only=True) for path in paths]
    averaged = {}
    for name, newest in states[-1].items():
        if newest.is_floating_point():
            total = sum(state[name].double() for state in states)
            averaged[name] = (total / len(states)).to(newest.dtype)
        else:
            averaged[name] = newest
    return averaged


def train(
    model: nn.Module,
    task: TrainingTask,
    cfg: TrainConfig,
    out_dir: Path,
    resume: bool = True,
    progress: bool = True,
) -> TrainState:
    """Train `model` on `task` until the step budget of `cfg` is spent; resumes from `out_dir` if it can."""
    if cfg.average_last and (cfg.ema_decay is not None or cfg.keep_best):
        raise ValueError("average_last averages the last evaluations' weights; it excludes ema_decay and keep_best")
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_path = out_dir / CHECKPOINT_NAME
    torch.manual_seed(cfg.seed)
    optimizer = build_optimizer(model, cfg)
    average = weight_average(model, cfg)
    evaluated = model if average is None else average.module  # the weights the curve, keep_best and the end use
    state = TrainState()
    if resume and checkpoint_path.exists():
        saved = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        if average is not None and saved.get("average") is not None:
            average.load_state_dict(saved["average"])
        state = TrainState(**saved["state"])
        torch.set_rng_state(saved["rng"])
        if saved.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda_rng"])  # dropout on a GPU draws from the GPU's generator
        if progress:
            print(f"resuming from {checkpoint_path} at step {state.step} (epoch {state.epoch})")

    per_epoch = task.steps_per_epoch()
    total = total_steps(cfg, per_epoch)
    eval_every = cfg.eval_every or per_epoch
    bar = tqdm(total=total, initial=state.step, disable=not progress, unit="step", dynamic_ncols=True)
    smoothed = None
    model.train()
    while state.step < total:
        for index, batch in enumerate(task.batches(state.epoch)):
            if index < state.batch_in_epoch:
                continue  # consumed before the checkpoint we resumed from
            started = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = cfg.lr * lr_factor(state.step, cfg, total)
            loss, units = task.loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip:
                nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            if average is not None:
                average.update_parameters(model)
            elapsed = time.perf_counter() - started
            state.seconds += elapsed
            state.step += 1
            state.batch_in_epoch = index + 1
            value = loss.item()
            smoothed = value if smoothed is None else 0.95 * smoothed + 0.05 * value
            state.history["train_loss"].append([state.step, value])
            bar.update(1)
            bar.set_postfix(epoch=state.epoch, loss=f"{smoothed:.3f}", units_per_s=f"{units / elapsed:,.0f}")

            last = state.step >= total
            if state.step % eval_every == 0 or last:
                val = task.validation_loss(evaluated)
                model.train()
                state.history["val_loss"].append([state.step, val])
                bar.write(f"step {state.step}: train loss {smoothed:.4f}, validation loss {val:.4f}")
                if cfg.average_last:
                    _snapshot(evaluated, out_dir, state.step, cfg.average_last)
                if cfg.keep_best and (state.best_val_loss is None or val < state.best_val_loss):
                    _save_atomically(evaluated.state_dict(), out_dir / BEST_NAME)
                    state.best_val_loss, state.best_step = val, state.step
            if last and state.batch_in_epoch == per_epoch:  # the budget ended exactly with an epoch
                state.epoch, state.batch_in_epoch = state.epoch + 1, 0
            if state.step % cfg.checkpoint_every == 0 or last:
                _save_checkpoint(checkpoint_path, model, optimizer, state, average)
            if last:
                break
        else:
            state.epoch += 1
            state.batch_in_epoch = 0
            _save_checkpoint(checkpoint_path, model, optimizer, state, average)
            continue
        break
    bar.close()
    if average is not None:
        model.load_state_dict(average.module.state_dict())
    if cfg.keep_best and state.best_step is not None:
        model.load_state_dict(torch.load(out_dir / BEST_NAME, map_location="cpu", weights_only=True))
        if progress:
            print(f"kept the weights of step {state.best_step} (validation loss {state.best_val_loss:.4f})")
    if cfg.average_last:
        model.load_state_dict(average_snapshots(out_dir, cfg.average_last))
        averaged = task.validation_loss(model)
        state.history["averaged_val_loss"] = [[state.step, averaged]]
        if progress:
            print(f"averaged the weights of the last {cfg.average_last} evaluations (validation loss {averaged:.4f})")
    model.eval()
    (out_dir / "history.json").write_text(json.dumps(state.history))
    return state
