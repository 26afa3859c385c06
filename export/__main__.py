"""Command line: export a trained run into the model repository, check it, and write its model card.

    python -m export {translation,gpt,vit} --checkpoint RUN_DIR --repository DIR [--version N] [--name NAME]

Writes DIR/<name>/<version>/ (name defaults to the kind; version to one above the highest present) with the ONNX
graph(s), tokenizer.json, config.json and the model card (metrics.json, README.md, curves.png). The parity checks
of `export.checks` must pass, or nothing is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from export.repository import export_run
from models.data import DataError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("translation", "gpt", "vit"))
    parser.add_argument("--checkpoint", type=Path, required=True, help="run folder of python -m models.train")
    parser.add_argument("--repository", type=Path, required=True, help="model repository root")
    parser.add_argument("--name", default=None, help="model name in the repository (default: the kind)")
    parser.add_argument("--version", type=int, default=None, help="version number (default: highest + 1)")
    parser.add_argument("--data-dir", default=None, help="data for the parity checks (default: $TSERVE_DATA_DIR)")
    parser.add_argument("--weights", choices=("fp32", "fp16"), default="fp32",
                        help="fp16: store weights as float16 (half the file size; computed in float32)")
    args = parser.parse_args(argv)
    try:
        path = export_run(args.kind, args.checkpoint, args.repository, args.name, args.version, args.data_dir,
                          args.weights)
    except (FileNotFoundError, ValueError, DataError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"exported {args.kind} to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
