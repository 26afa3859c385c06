"""Which variant each model version runs (`load_engine`): the one `TSERVE_VARIANT` pins (`parse_pins`), else the
fastest on this host of those the version offers, as `service.models.calibration` measures them (or cached them).
`python -m service.models.calibrate` is the explicit calibration step (the same choice, ahead of a start).

A version offers (`offered`) the variant it is stored in and each other one that `export.variants` derived from it
and quality-checked at export against the model card (config.json `variants`). The choice (`fastest`) is the
geometric mean of each variant's slowdowns over the batch sizes measured; the stored variant keeps its place unless
another beats it by more than `MARGIN`, so that noise does not flip the choice from one start to the next.

Invariant: nothing unchecked is chosen, so a variant that would answer worse than its card is never chosen; a
pinned variant the version does not offer still runs (an operator's explicit override), logged as a warning.

Design notes: docs/architecture.md, service/models/variants.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from service.engines.runtime import RuntimeOptions
from service.engines.weights import VARIANTS, compute_weights
from service.models.calibration import CalibrationCache, calibration_key, measure
from service.repository import ModelVersion

log = logging.getLogger(__name__)

AUTO, STORED = "auto", "stored"
PIN_VALUES = (AUTO, STORED, *VARIANTS)
ALL_MODELS = "*"  # the pin of a value without a model name
MARGIN = 0.05  # a derived variant must be this much faster than the stored one to replace it
# how the variant was chosen (the `chosen_by` of /v1/models and the model info metric)
PINNED, ONLY, MEASURED, CACHED = "pinned", "only variant", "measured", "cached measurement"


@dataclass(frozen=True)
class Choice:
    weights: str  # the variant that runs
    offered: tuple[str, ...]  # the stored one first (`offered`)
    chosen_by: str  # PINNED, ONLY, MEASURED or CACHED
    reason: str
    timings: dict[str, dict[int, float]] = field(default_factory=dict)  # variant -> rows -> seconds per item

    @property
    def stored(self) -> str:
        """The variant the repository holds."""
        return self.offered[0]

    def report(self) -> dict[str, str]:
        """What /v1/models and the model info metric say of the choice besides the weights themselves."""
        return {"offered_weights": ",".join(self.offered), "chosen_by": self.chosen_by}


def parse_pins(spec: str) -> dict[str, str]:
    """TSERVE_VARIANT -> model name (or `ALL_MODELS`) -> pinned value; raises ValueError naming what is wrong."""
    pins: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, equals, value = (x.strip() for x in part.rpartition("=")) if "=" in part else (ALL_MODELS, "", part)
        if value not in PIN_VALUES or (equals and not name) or name in pins:
            raise ValueError(f"bad TSERVE_VARIANT entry {part!r}: expected VALUE or MODEL=VALUE, each model once, "
                             f"VALUE one of {', '.join(PIN_VALUES)}")
        pins[name] = value
    return pins


def pin_for(pins: Mapping[str, str], name: str) -> str:
    return pins.get(name, pins.get(ALL_MODELS, AUTO))


def offered(model: ModelVersion) -> tuple[str, ...]:
    """The stored variant first, then those config.json `variants` records as derived and checked."""
    stored = compute_weights(model.config.get("weights", "fp32"))
    checked = model.config.get("variants") or {}
    return (stored, *(v for v in VARIANTS if v != stored and isinstance(checked.get(v), dict)))


def fastest(timings: Mapping[str, Mapping[int, float]], stored: str, margin: float = MARGIN) -> str:
    """The variant with the smallest geometric mean, over the batch sizes, of its time over the best time at that
    size; the stored one unless another beats it by more than `margin`."""
    sizes = sorted(set.intersection(*(set(t) for t in timings.values())))
    best = {size: min(t[size] for t in timings.values()) for size in sizes}
    score = {v: math.exp(sum(math.log(t[size] / best[size]) for size in sizes) / len(sizes))
             for v, t in timings.items()}
    winner = min(score, key=score.get)
    if stored in score and score[stored] <= score[winner] * (1 + margin):
        return stored
    return winner


def describe(timings: Mapping[str, Mapping[int, float]], unit: str) -> str:
    """'int8 0.61/0.20 ms, fp32 0.85/0.17 ms per token at 1/64 rows'."""
    sizes = sorted(next(iter(timings.values())))
    parts = [f"{v} {'/'.join(f'{t[s] * 1e3:.3g}' for s in sizes)} ms" for v, t in timings.items()]
    return f"{', '.join(parts)} per {unit} at {'/'.join(map(str, sizes))} rows"


def load_engine(model: ModelVersion, kind, options: RuntimeOptions, pin: str, rows: Sequence[int],
                cache: CalibrationCache) -> tuple[Any, Choice]:
    """The version's engine in the variant chosen for it (the module's docstring says how) and that choice.
    `kind`: its `service.models.kinds.ModelKind`; `rows`: the batch sizes to calibrate at."""
    variants = offered(model)
    stored = variants[0]
    if pin != AUTO:
        weights = stored if pin == STORED else pin
        unchecked = "" if weights in variants else (f"; version {model.version} records no quality check of it "
                                                    f"(offered: {', '.join(variants)})")
        if unchecked:  # an operator's override, and how `export.variants` measures a variant before it is offered
            log.warning("%s:%d runs %s weights, pinned, unchecked%s", model.name, model.version, weights, unchecked)
        engine = kind.engine(model, replace(options, weights=weights))
        return engine, Choice(weights, variants, PINNED, f"pinned by TSERVE_VARIANT ({pin}){unchecked}")
    if len(variants) == 1:
        engine = kind.engine(model, replace(options, weights=stored))
        return engine, Choice(stored, variants, ONLY, "the only variant this version offers (its "
                              "config.json records no other checked one)")
    engines = {stored: kind.engine(model, replace(options, weights=stored))}
    key = calibration_key(model, engines[stored].provider, options, rows, variants)
    cached = cache.get(key)  # None, and logged why, unless a valid measurement of this key
    if cached is not None:
        timings, chosen_by, when = cached.timings, CACHED, f"measured {cached.measured_at}, cached"
    else:
        for weights in variants[1:]:
            try:  # built and run once: a variant this provider cannot build or run is not a candidate
                engines[weights] = kind.engine(model, replace(options, weights=weights))
                kind.calibration(engines[weights], 1)
            except Exception as error:
                engines.pop(weights, None)
                log.warning("%s:%d: the %s variant does not run here (%s); not a candidate", model.name,
                            model.version, weights, error)
        timings = measure(engines, kind.calibration, rows)
        chosen_by, when = MEASURED, f"measured {cache.put(key, timings)}"
    weights = fastest(timings, stored)
    engine = engines.get(weights) or kind.engine(model, replace(options, weights=weights))
    reason = (f"{'fastest' if weights != stored else 'stored, and none faster by ' + format(MARGIN, '.0%')} on "
              f"{key['cpu']}: {describe(timings, kind.calibration_unit)} ({when})")
    log.info("%s:%d runs %s weights: %s", model.name, model.version, weights, reason)
    return engine, Choice(weights, variants, chosen_by, reason, timings)
