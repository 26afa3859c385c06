"""How far a measured quality figure may sit from the model card's, for the export checks and `verify_served`.

Loss and BLEU have fixed tolerances. An accuracy measured on N images moves in steps of 100/N points, and another
CPU's kernels (or another graph variant) flip the near-tie images either way, so a fixed tolerance that is a few
images on the release set (10,000) is one image on a 500-image fixture. The accuracy tolerance is therefore the
larger of a floor and one binomial standard error of an accuracy measured on that many images: the difference
the sample cannot resolve (10,000 images at 92%: 0.27 points; 500 images at 70%: 2.05 points).
"""

from __future__ import annotations

import math

# A graph variant against the float32 (PyTorch) figure: validation loss may rise by 0.002 nats, BLEU move by 0.3;
# accuracy (percent) by the floor or the binomial standard error (`accuracy_tolerance`).
TOLERANCES = {"val_loss": 0.002, "bleu": 0.3, "test_accuracy": 0.2}
# The served model through HTTP against its card: the same graph, so tighter floors.
SERVED_BLEU_TOLERANCE = 0.2
SERVED_ACCURACY_FLOOR = 0.1


def accuracy_tolerance(reference_percent: float, count: int, floor: float) -> float:
    """Percentage points an accuracy of `reference_percent` measured on `count` examples may move: the larger of
    `floor` and one binomial standard error, 100 * sqrt(p (1 - p) / count), rounded to 2 places."""
    if count < 1:
        raise ValueError(f"an accuracy needs at least one example, got {count}")
    p = min(max(reference_percent / 100.0, 0.0), 1.0)
    return round(max(floor, 100.0 * math.sqrt(p * (1.0 - p) / count)), 2)


def quality_tolerance(metric: str, reference: float, count: int, tolerances: dict[str, float] = TOLERANCES) -> float:
    """The tolerance of `metric` (a key of TOLERANCES) for a figure of `reference` measured on `count` examples."""
    if metric == "test_accuracy":
        return accuracy_tolerance(reference, count, tolerances[metric])
    return tolerances[metric]


def within(metric: str, delta: float, tolerance: float) -> bool:
    """A loss may fall by any amount (lower is better) and rise by `tolerance`; the others move either way."""
    return delta <= tolerance if metric == "val_loss" else abs(delta) <= tolerance
