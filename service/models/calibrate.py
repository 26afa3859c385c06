"""`python -m service.models.calibrate [NAME[:VERSION] ...] [--again] [--pins]`: the explicit calibration step.
Times (or reads from the cache) each model's weights variants as the server does when it loads them
(`service.models.variants.load_engine`, with the same TSERVE_* settings), writes the timings into
TSERVE_CALIBRATION_CACHE and prints each choice. Run it where the service will run (in the image before the
server, a Kubernetes init container sharing the cache file's volume): the server's start then reads the timings
instead of measuring. `--pins` prints only the choices, as one TSERVE_VARIANT value (`gpt=int8+gqa,translation=int8`):
what the engine benchmark's `shipped` system runs (`bench/bench_engine.py --shipped-variant auto`). Exit status 0,
2 for a model or setting that is wrong.
"""

from __future__ import annotations

import argparse
import sys

from service.models.calibration import CalibrationCache
from service.models.kinds import KIND_TABLE
from service.models.registry import calibration_rows, parse_model_spec, runtime_options
from service.repository import ModelRepository, RepositoryError
from service.models.variants import load_engine, pin_for
from service.settings import SettingsInvalid, load_settings


class _Uncached(CalibrationCache):
    """A cache that is written but never read (`--again`)."""

    def get(self, key):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.models.calibrate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", help="NAME or NAME:VERSION (default: TSERVE_MODELS, else every model)")
    parser.add_argument("--again", action="store_true", help="measure even where the cache has timings")
    parser.add_argument("--pins", action="store_true",
                        help="print only the choices, as one TSERVE_VARIANT value (name=variant,...)")
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
    except SettingsInvalid as error:
        print(f"error: invalid configuration:\n{error}", file=sys.stderr)
        return 2
    repository = ModelRepository(settings.repository, settings.model_name)
    path = settings.calibration_cache_path
    cache = _Uncached(path) if args.again else CalibrationCache(path)
    pins = []
    try:
        for spec in args.models or settings.models or repository.model_names():
            name, version = parse_model_spec(spec)
            model = repository.get(name, version)
            kind = KIND_TABLE[model.kind]
            _, choice = load_engine(model, kind, runtime_options(settings, kind), pin_for(settings.variant_pins, name),
                                    calibration_rows(settings, kind), cache)
            pins.append(f"{model.name}={choice.weights}")
            if not args.pins:
                print(f"{model.name}:{model.version} runs {choice.weights} ({choice.chosen_by}): {choice.reason}")
    except (RepositoryError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.pins:
        print(",".join(pins))
    else:
        print(f"timings cached in {path}" if path else "timings not kept (TSERVE_CALIBRATION_CACHE is empty)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
