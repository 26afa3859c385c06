"""Training curves as a PNG: training loss (raw and smoothed) and validation loss against steps."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers and in CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_history(history: dict[str, list[list[float]]], path: Path, title: str, kept_step: int | None = None) -> None:
    """`kept_step`: the step whose weights the run kept (keep_best), marked with a vertical line."""
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    train = np.asarray(history.get("train_loss") or [[0, np.nan]], dtype=float)
    ax.plot(train[:, 0], train[:, 1], color="tab:blue", alpha=0.25, linewidth=0.8)
    window = max(1, len(train) // 50)
    if len(train) >= window:
        smooth = np.convolve(train[:, 1], np.ones(window) / window, mode="valid")
        ax.plot(train[window - 1 :, 0], smooth, color="tab:blue", label="train loss")
    val = np.asarray(history.get("val_loss") or [[0, np.nan]], dtype=float)
    ax.plot(val[:, 0], val[:, 1], "o-", color="tab:orange", label="validation loss")
    averaged = history.get("averaged_val_loss")  # average_last: the averaged weights' one point, at the end
    if averaged:
        ax.plot(*np.asarray(averaged, dtype=float).T, "*", markersize=12, color="tab:red",
                label="validation loss, averaged weights")
    if kept_step is not None:
        ax.axvline(kept_step, color="tab:green", linestyle="--", label=f"kept weights (step {kept_step:,})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
