"""The graph variant the release models are served in, for the benchmarks' own random-weight models.

The committed model repository's highest version of each kind records in its config.json how its graphs were
rewritten (`export.repository.rewrite_graphs`: weights, attention, kv_cache) and the choices its evaluation made
that change the graph (the ViT's test-time flip averaging); the benchmarks build and rewrite their random-weight
exports the same way, so that they time what a user is served.

On top of the stored graph, the service runs the weights variant its start-up calibration chose on the host
(`service.models.variants`: int8 beside fp32, `+gqa`); `served_variants` asks the service which, through
`python -m service.models.calibrate --pins` in the project's own venv (the benchmark venv has no serving stack), so
that `shipped` runs what this host is served.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPOSITORY = ROOT / "model_repository"
VARIANT_OPTIONS = ("weights", "attention", "kv_cache")
SERVICE_PYTHON = ROOT / ".venv" / "bin" / "python"  # the venv `make serve` runs the service from
CALIBRATION_TIMEOUT_S = 600  # a first calibration of the three release models takes ~30 s on 2 cores


def shipped_variant(kind: str) -> dict[str, str]:
    """`rewrite_graphs`'s options for the release model of `kind` (empty: served as exported)."""
    from service.repository import ModelRepository

    config = ModelRepository(REPOSITORY).get(kind).config
    return {option: config[option] for option in VARIANT_OPTIONS if option in config}


def shipped_choices(kind: str) -> dict[str, object]:
    """The model-config fields the release model of `kind` was exported with that its evaluation chose (the ViT's
    `flip_average`), to build the benchmark's random-weight model alike."""
    from models.config import CHOSEN_AT_EVALUATION
    from service.repository import ModelRepository

    architecture = ModelRepository(REPOSITORY).get(kind).config.get("architecture", {})
    return {name: architecture[name] for name in CHOSEN_AT_EVALUATION if name in architecture}


def served_variants() -> tuple[str | None, str]:
    """The variant the service runs each release model in on this host, as one TSERVE_VARIANT value
    (`gpt=int8+gqa,translation=int8,vit=fp32`), from its calibration (cached per CPU, measured when not), and where
    that came from; (None, why) when it cannot be asked (no service venv, the calibration failed): then `shipped`
    runs the stored variant."""
    if not SERVICE_PYTHON.exists():
        return None, f"no service venv at {SERVICE_PYTHON} (make venv): the stored variants"
    # the service's own interpreter and packages, not this venv's; its settings (TSERVE_*) as the service has them
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    try:
        done = subprocess.run([str(SERVICE_PYTHON), "-m", "service.models.calibrate", "--pins"], cwd=ROOT,
                              capture_output=True, text=True, timeout=CALIBRATION_TIMEOUT_S,
                              env={**env, "TSERVE_REPOSITORY": str(REPOSITORY)})
    except subprocess.TimeoutExpired:
        return None, f"service.models.calibrate took over {CALIBRATION_TIMEOUT_S} s: the stored variants"
    pins = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else ""
    if not pins:
        return None, f"service.models.calibrate failed ({done.stderr.strip()[-300:]}): the stored variants"
    return pins, "the service's calibration on this host (python -m service.models.calibrate --pins)"
