"""What every ratio of both benchmarks (bench_engine.py, bench_http.py) carries besides its value: its spread over
the interleaved rounds (each round's ratio from that round's two figures: one system misbehaving in one round shows
as spread, not as the ratio), a flag when the rounds disagree, the machine's 1-minute load before and after the
timed rounds, and the verdict against a goal."""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterator
from contextlib import contextmanager

# a ratio whose rounds disagree by more than this (max / min of the per-round ratios) is flagged as unreliable
SPREAD_FLAG = 1.3
LOAD_DIGITS = 2  # the load average as recorded and printed


def ratio_spread(numerator: list[float | None], denominator: list[float | None]) -> dict | None:
    """The per-round ratios numerator[r] / denominator[r] (rounds where either figure is missing or not positive
    left out) -> median, min, max, the rounds counted and whether max / min exceeds `SPREAD_FLAG`; None without a
    common round."""
    ratios = [x / y for x, y in zip(numerator, denominator) if x is not None and y is not None and x > 0 and y > 0]
    if not ratios:
        return None
    low, high = min(ratios), max(ratios)
    return {"median": statistics.median(ratios), "min": low, "max": high, "rounds": len(ratios),
            "flagged": high / low > SPREAD_FLAG}


def spread_text(spread: dict) -> str:
    """`rounds 1.00-2.00, median 2.00 of 3`, and `FLAGGED: ...` after it when the rounds disagree."""
    return (f"rounds {spread['min']:.2f}-{spread['max']:.2f}, median {spread['median']:.2f} of {spread['rounds']}"
            + (f"   FLAGGED: rounds disagree by more than {SPREAD_FLAG:.1f}x" if spread["flagged"] else ""))


def load_average() -> float:
    """The machine's 1-minute load average, rounded as recorded."""
    return round(os.getloadavg()[0], LOAD_DIGITS)


@contextmanager
def sampled_load(into: list[tuple[float, float]]) -> Iterator[None]:
    """Append (the 1-minute load average before, after) the block's timed rounds to `into`."""
    before = load_average()
    yield
    into.append((before, load_average()))


def load_text(before: float, after: float) -> str:
    return f"machine load (1-minute average) before / after the timed rounds: {before:.2f} / {after:.2f}"


def judge(value: float | None, goal: tuple[str, float] | None, errors: int = 0) -> str | None:
    """PASS or MISS against the goal, (`"<="` or `">="`, threshold) (any error in the cases voids a PASS); None
    without a goal or a value."""
    if goal is None or value is None:
        return None
    op, threshold = goal
    met = value <= threshold if op == "<=" else value >= threshold
    return "PASS" if met and not errors else "MISS"
