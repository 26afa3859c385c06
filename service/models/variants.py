"""Which variant each model version runs (`load_engine`): the one `TSERVE_VARIANT` pins (`parse_pins`), else the
fastest on this host of those the version offers on its provider, as `service.models.calibration` measures them.
`python -m service.models.calibrate` is the explicit calibration step (the same choice, ahead of a start).

A version offers (`offered`, a function of its config and the provider) its stored variant and each other one that
`export.variants` quality-checked at export (config.json `variants`), and on CUDA the float16 ones, which the CPU
cannot check (`provider_limit`: what a provider does not offer, and why; `not_offered`, shown by /v1/models). The
choice (`fastest`): the geometric mean of each variant's slowdowns over the batch sizes measured; the stored variant
keeps its place unless another beats it by more than `MARGIN`, so that noise does not flip it from start to start.

Invariant: nothing is chosen that neither an export check nor tests/gpu holds to the float32 outputs; a pinned
variant the version does not offer still runs (an operator's explicit override), logged as a warning.

Design notes: docs/architecture.md, service/models/variants.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from service.per_model import parse_per_model, value_for
from service.engines.runtime import CPU, CUDA, RuntimeOptions, preferred_providers
from service.engines.weights import (ALL_VARIANTS, FLOAT16_VARIANTS, FP16, INT8_ROWS, VARIANTS, changes_step_attention,
                                     compute_weights, split_variant)
from service.models.calibration import CalibrationCache, calibration_key, measure_against
from service.repository import ModelVersion

log = logging.getLogger(__name__)

AUTO, STORED = "auto", "stored"
PIN_VALUES = (AUTO, STORED, *ALL_VARIANTS)
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
    not_offered: dict[str, str] = field(default_factory=dict)  # variant -> why not, on this provider (`not_offered`)

    @property
    def stored(self) -> str:
        """The variant the repository holds."""
        return self.offered[0]

    def report(self) -> dict[str, str]:
        """What /v1/models and the model info metric say of the choice besides the weights themselves."""
        return {"offered_weights": ",".join(self.offered), "chosen_by": self.chosen_by}


def parse_pins(spec: str) -> dict[str, str]:
    """TSERVE_VARIANT -> model name (or `service.per_model.ALL_MODELS`) -> pinned value; raises ValueError naming what is wrong."""
    def pin(value: str) -> str:
        if value not in PIN_VALUES:
            raise ValueError(f"one of {', '.join(PIN_VALUES)}")
        return value

    return parse_per_model(spec, "TSERVE_VARIANT", pin)


def pin_for(pins: Mapping[str, str], name: str) -> str:
    return value_for(pins, name, AUTO)


# Why a provider does not offer a variant (measured with ONNX Runtime 1.32 on CPU; its CUDA kernels' types from its
# docs/OperatorKernels.md): each still runs when pinned, at the cost the reason names
CPU_FLOAT16 = ("ONNX Runtime's CPU provider runs most float16 ops by casting them to float32: float16-rounded "
               "weights, no faster (the release GPT's step 1.93 ms against fp32's 1.57 ms, 2 cores)")
CUDA_FLOAT_GQA = ("ONNX Runtime's CUDA GroupQueryAttention takes float16 or bfloat16 only: its nodes would run on "
                  "the CPU, the cache copied there and back at every step (fp16+gqa is CUDA's)")
CUDA_INTEGER_GEMM = ("int8rows runs on ONNX Runtime's CPU integer GEMM (MLAS): on CUDA its quantiser and "
                     "MatMulIntegerToFloat nodes would run on the CPU, every activation copied there and back")
NOT_CHECKED = "config.json `variants` records no passing check of it at export (`export.variants`)"
NO_STEP_REWRITE = "no +gqa variant of this version passed its check at export: its step graph's rewrite is unchecked"


def provider_limit(variant: str, provider: str) -> str | None:
    """Why `provider` does not offer `variant` whatever the version, or None."""
    weights, attention = split_variant(variant)
    if weights == FP16 and provider != CUDA:
        return CPU_FLOAT16 if provider == CPU else f"float16 variants are offered on {CUDA} only"
    if weights == INT8_ROWS and provider == CUDA:
        return CUDA_INTEGER_GEMM
    if attention is not None and weights != FP16 and provider == CUDA:
        return CUDA_FLOAT_GQA
    return None


def _checked(model: ModelVersion, variant: str) -> str | None:
    """Why `model` does not offer `variant` on a provider that runs it, or None: the export-time check for
    `VARIANTS`; for the float16 ones (checked by tests/gpu, not at export), that of their step graph's rewrite."""
    checked = model.config.get("variants") or {}
    if variant not in FLOAT16_VARIANTS:
        return None if isinstance(checked.get(variant), dict) else NOT_CHECKED
    rewritten = any(isinstance(r, dict) and changes_step_attention(v) for v, r in checked.items() if v in VARIANTS)
    return None if not changes_step_attention(variant) or rewritten else NO_STEP_REWRITE


def offered(model: ModelVersion, provider: str) -> tuple[str, ...]:
    """The stored variant first, then those the version offers on `provider` (the module's docstring says which)."""
    stored = compute_weights(model.config.get("weights", "fp32"))
    return (stored, *(v for v in ALL_VARIANTS if v != stored and provider_limit(v, provider) is None
                      and _checked(model, v) is None))


def not_offered(model: ModelVersion, provider: str) -> dict[str, str]:
    """Each variant the version does not offer on `provider`, with why (the provider's reason first)."""
    stored = compute_weights(model.config.get("weights", "fp32"))
    reasons = {v: provider_limit(v, provider) or _checked(model, v) for v in ALL_VARIANTS if v != stored}
    return {v: reason for v, reason in reasons.items() if reason is not None}


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
    provider = preferred_providers(options.device)[0]  # until a session says which one started
    variants, refused = offered(model, provider), not_offered(model, provider)
    stored = variants[0]
    if pin != AUTO:
        weights = stored if pin == STORED else pin
        unchecked = "" if weights in variants else (f"; version {model.version} does not offer it on {provider}: "
                                                    f"{refused.get(weights)} (offered: {', '.join(variants)})")
        if unchecked:  # an operator's override, and how `export.variants` measures a variant before it is offered
            log.warning("%s:%d runs %s weights, pinned, not offered%s", model.name, model.version, weights, unchecked)
        engine = kind.engine(model, replace(options, weights=weights))
        return engine, Choice(weights, variants, PINNED, f"pinned by TSERVE_VARIANT ({pin}){unchecked}",
                              not_offered=refused)
    engines = {stored: kind.engine(model, replace(options, weights=stored))}
    if engines[stored].provider != provider:  # CUDA did not start: ONNX Runtime fell back to the CPU
        provider = engines[stored].provider
        variants, refused = offered(model, provider), not_offered(model, provider)
    if len(variants) == 1:
        return engines[stored], Choice(stored, variants, ONLY, f"the only variant this version offers on {provider} "
                                       "(not_offered says why not the others)", not_offered=refused)
    key = calibration_key(model, provider, options, rows, variants)
    cached = cache.get(key)  # None, and logged why, unless a valid measurement of this key
    if cached is not None:
        timings, chosen_by, when = cached.timings, CACHED, f"measured {cached.measured_at}, cached"
    else:
        def build(weights: str):
            try:  # built and run once: a variant this provider cannot build or run is not a candidate
                candidate = kind.engine(model, replace(options, weights=weights))
                kind.calibration(candidate, 1)
                return candidate
            except Exception as error:
                log.warning("%s:%d: the %s variant does not run here (%s); not a candidate", model.name,
                            model.version, weights, error)
                return None

        timings = measure_against(stored, engines[stored], variants[1:], build, kind.calibration, rows)
        chosen_by, when = MEASURED, f"measured {cache.put(key, timings)}"
    weights = fastest(timings, stored)
    engine = engines.get(weights) or kind.engine(model, replace(options, weights=weights))
    reason = (f"{'fastest' if weights != stored else 'stored, and none faster by ' + format(MARGIN, '.0%')} on "
              f"{key['cpu']}: {describe(timings, kind.calibration_unit)} ({when})")
    log.info("%s:%d runs %s weights: %s", model.name, model.version, weights, reason)
    return engine, Choice(weights, variants, chosen_by, reason, timings, refused)
