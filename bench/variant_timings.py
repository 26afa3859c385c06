"""Seconds per token (or image) of a model's weights variants, engine only, as the start-up calibration measures
them (`service.models.calibration.measure`: its kind's workload, interleaved rounds, medians), at chosen batch sizes;
each variant's ratio against the first one named (> 1: faster).

    .venv/bin/python bench/variant_timings.py gpt int8+gqa+kv8,int8rows+gqa+kv8 1,16,64 [rounds]

The repository is model_repository/ (TSERVE_* settings apply, e.g. TSERVE_PREFIX_CACHE=false); a variant need not
be offered by the version (it is pinned, as TSERVE_VARIANT would). Prints the CPU first.
"""

import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpuinfo import describe  # noqa: E402
from service.models.calibration import measure  # noqa: E402
from service.models.kinds import KIND_TABLE  # noqa: E402
from service.models.registry import runtime_options  # noqa: E402
from service.repository import ModelRepository  # noqa: E402
from service.settings import load_settings  # noqa: E402

ROUNDS = 5


def main() -> int:
    if len(sys.argv) not in (4, 5):
        print(__doc__, file=sys.stderr)
        return 2
    name, variants = sys.argv[1], sys.argv[2].split(",")
    rows = [int(r) for r in sys.argv[3].split(",")]
    rounds = int(sys.argv[4]) if len(sys.argv) == 5 else ROUNDS
    print(describe())
    settings = load_settings()
    model = ModelRepository(ROOT / "model_repository").get(name)
    kind = KIND_TABLE[model.kind]
    options = runtime_options(settings, kind)
    engines = {v: kind.engine(model, replace(options, weights=v)) for v in variants}
    timings = measure(engines, kind.calibration, rows, rounds=rounds)
    base = variants[0]
    for v in variants:
        print(v, "  ".join(f"{r} rows: {timings[v][r] * 1e6:.0f} us/item ({timings[base][r] / timings[v][r]:.2f}x)"
                           for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
