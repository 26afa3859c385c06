"""Train several presets of one task side by side, each in its own process, and rank them by validation loss.

    python -m models.sweep gpt --presets deep-b32,wide --device cuda --out runs/sweep [--time-budget 420]

Made for a GPU lent for minutes: a model of a few million parameters leaves most of the GPU idle between kernel
launches, so presets trained at once cost little more than one. Each run is an ordinary `python -m models.train`
run folder (resumable, with its metrics.json). With `--time-budget`, every preset first trains `CALIBRATION_STEPS`
steps (all at once, as in the sweep itself), and a preset whose step budget would not fit in the time left is
given fewer steps (`--max-steps`: its cosine schedule then ends sooner); the table says so. The ranking is written
to `<out>/sweep.json`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from models.config import TASKS, get_preset

CALIBRATION_STEPS = 100  # steps of the timing run (its first steps include the device's warm-up: errs short)
TIME_SAFETY = 0.85  # share of the time left that the step budgets may fill (evaluations, start-up, the end's)
SWEEP_FILE = "sweep.json"
PROJECT_ROOT = Path(__file__).resolve().parents[1]  # where `python -m models.train` resolves


def fitted_steps(nominal: int | None, seconds_per_step: float, seconds_left: float) -> int:
    """The step budget a preset gets: its own, or fewer where that would not fit in `TIME_SAFETY` of the time left."""
    fits = int(seconds_left * TIME_SAFETY / seconds_per_step)
    if fits < 1:
        raise SystemExit(f"the time budget is spent ({seconds_left:.0f} s left after the calibration)")
    return fits if nominal is None else min(nominal, fits)


def train_command(task: str, preset: str, out: Path, args: argparse.Namespace, max_steps: int | None,
                  fresh: bool) -> list[str]:
    command = [sys.executable, "-m", "models.train", task, "--preset", preset, "--out", str(out),
               "--device", args.device, "--threads", str(args.threads), "--quiet"]
    if args.data_dir:
        command += ["--data-dir", args.data_dir]
    if max_steps is not None:
        command += ["--max-steps", str(max_steps)]
    return command + (["--fresh"] if fresh else [])


def run_side_by_side(task: str, steps: dict[str, int | None], folder: dict[str, Path], args: argparse.Namespace,
                     fresh: bool = False) -> dict[str, int]:
    """Start one training process per preset, wait for all; their exit codes."""
    processes = {}
    for preset, max_steps in steps.items():
        folder[preset].mkdir(parents=True, exist_ok=True)
        command = train_command(task, preset, folder[preset], args, max_steps, fresh)
        with (folder[preset] / "train.log").open("a") as log:  # the child keeps its own descriptor
            processes[preset] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=PROJECT_ROOT)
    return {preset: process.wait() for preset, process in processes.items()}


def read_metrics(folder: Path) -> dict | None:
    path = folder / "metrics.json"
    return json.loads(path.read_text()) if path.exists() else None


def calibrate(task: str, presets: list[str], args: argparse.Namespace) -> dict[str, float]:
    """Seconds per training step of each preset, measured with all of them training at once."""
    folders = {p: args.out / f"{p}.calibration" for p in presets}
    codes = run_side_by_side(task, {p: CALIBRATION_STEPS for p in presets}, folders, args, fresh=True)
    seconds = {}
    for preset in presets:
        metrics = read_metrics(folders[preset])
        if codes[preset] != 0 or metrics is None:
            raise SystemExit(f"calibration run of {preset} failed (exit {codes[preset]}): "
                             f"see {folders[preset]}/train.log")
        seconds[preset] = metrics["train_seconds"] / metrics["steps"]
    return seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m models.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("task", choices=TASKS)
    parser.add_argument("--presets", required=True, help="comma-separated preset names from models/config.py")
    parser.add_argument("--out", type=Path, default=Path("runs/sweep"), help="folder of the run folders")
    parser.add_argument("--device", default="auto", help="passed to every models.train run")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of each run")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds the whole sweep may take; presets that would not fit get fewer steps")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()  # the runs start in the project's root, not necessarily the caller's folder
    if args.data_dir:
        args.data_dir = str(Path(args.data_dir).resolve())
    started = time.monotonic()
    presets = [p for p in args.presets.split(",") if p]
    try:
        nominal = {p: get_preset(args.task, p)[1].max_steps for p in presets}
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    steps: dict[str, int | None] = dict(nominal)
    per_step: dict[str, float] = {}
    if args.time_budget is not None:
        per_step = calibrate(args.task, presets, args)
        left = args.time_budget - (time.monotonic() - started)
        steps = {preset: fitted_steps(nominal[preset], per_step[preset], left) for preset in presets}
        print(f"calibrated in {time.monotonic() - started:.0f} s: " +
              ", ".join(f"{p} {1000 * per_step[p]:.0f} ms/step -> {steps[p]} steps" for p in presets), flush=True)
    folders = {p: args.out / p for p in presets}
    codes = run_side_by_side(args.task, steps, folders, args)
    rows = []
    for preset in presets:
        metrics = read_metrics(folders[preset]) if codes[preset] == 0 else None
        rows.append({"preset": preset, "exit_code": codes[preset], "nominal_steps": nominal[preset],
                     "steps": steps[preset], "calibrated_seconds_per_step": per_step.get(preset),
                     "metrics": metrics})
    rows.sort(key=lambda row: row["metrics"]["val_loss"] if row["metrics"] else float("inf"))
    (args.out / SWEEP_FILE).write_text(json.dumps(rows, indent=2))
    print(f"{'preset':<12} {'parameters':>11} {'steps':>11} {'val_loss':>9} {'kept_step':>9} {'train_s':>8}")
    for row in rows:
        m = row["metrics"] or {}
        budget = f"{row['steps']}/{row['nominal_steps']}"
        print(f"{row['preset']:<12} {m.get('parameters', '-'):>11} {budget:>11} {m.get('val_loss', 'failed'):>9} "
              f"{m.get('kept_step', '-'):>9} {m.get('train_seconds', '-'):>8}")
    print(f"sweep took {time.monotonic() - started:.0f} s; ranking in {args.out / SWEEP_FILE}")
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
