"""Make sure a model repository exists: every kind (translation, gpt, vit) missing from it is trained from its
`tiny` preset and exported. `make serve` runs this before starting the server; with the release models
committed in the repository it does nothing.

    python -m export.bootstrap --repository model_repository [--data-dir DIR] [--preset tiny]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from export.repository import export_run
from models.datasets import DataError
from models.train import main as train_main
from service.repository import ModelRepository


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.bootstrap", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=Path("model_repository"))
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    args = parser.parse_args(argv)
    repository = ModelRepository(args.repository)
    missing = [kind for kind in ("translation", "gpt", "vit") if not repository.versions(kind)]
    if not missing:
        print(f"model repository {args.repository}: {', '.join(repository.model_names())} present")
        return 0
    print(f"model repository {args.repository}: building {', '.join(missing)} from the {args.preset!r} presets")
    started = time.perf_counter()
    for kind in missing:
        run_dir = args.runs / f"{kind}-{args.preset}"
        print(f"[{kind}] training (python -m models.train {kind} --preset {args.preset})", flush=True)
        data = ["--data-dir", args.data_dir] if args.data_dir else []
        if train_main([kind, "--preset", args.preset, "--out", str(run_dir), *data]) != 0:
            return 2
        print(f"[{kind}] exporting to {args.repository}", flush=True)
        try:
            path = export_run(kind, run_dir, args.repository, data_dir=args.data_dir)
        except (DataError, ValueError, FileNotFoundError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        print(f"[{kind}] ready: {path}", flush=True)
    print(f"model repository built in {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
