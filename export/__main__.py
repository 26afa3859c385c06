"""Command line: export a trained run into the model repository, check it, and write its model card.

    python -m export {translation,gpt,vit} --checkpoint RUN_DIR --repository DIR [--version N] [--name NAME]
        [--weights {fp32,fp16,int8}] [--attention {plain,mha}] [--kv-cache {concat,inplace}]

Writes DIR/<name>/<version>/ (name defaults to the kind; version to one above the highest present) with the ONNX
graph(s), tokenizer.json, config.json and the model card (metrics.json, README.md, curves.png). The parity checks
of `export.checks` must pass, and an int8 or mha variant must keep the quality within `export.tolerances` (an
accuracy: by the sample's binomial standard error), or nothing is written. Then the weights variant it is not
stored in is checked the same way (`export.variants`; `--no-variant-check` skips it): the service offers it only
if it passed. Exit status: 0 written, 1 a check failed, 2 bad arguments or inputs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from export.checks import ExportCheckError
from export.repository import ATTENTION, KV_CACHE, WEIGHTS, export_run
from export.variants import check_variants, describe_result
from models.datasets import DataError
from service.repository import ModelRepository


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("translation", "gpt", "vit"))
    parser.add_argument("--checkpoint", type=Path, required=True, help="run folder of python -m models.train")
    parser.add_argument("--repository", type=Path, required=True, help="model repository root")
    parser.add_argument("--name", default=None, help="model name in the repository (default: the kind)")
    parser.add_argument("--version", type=int, default=None, help="version number (default: highest + 1)")
    parser.add_argument("--data-dir", default=None, help="data for the parity checks (default: $TSERVE_DATA_DIR)")
    parser.add_argument("--weights", choices=WEIGHTS, default="fp32",
                        help="fp16: store weights as float16 (half the file size; computed in float32); int8: "
                             "8-bit MatMul weights, ONNX Runtime's MatMulNBits (export.quantize)")
    parser.add_argument("--attention", choices=ATTENTION, default="plain",
                        help="mha: fuse attention into ONNX Runtime's contrib MultiHeadAttention")
    parser.add_argument("--kv-cache", choices=KV_CACHE, default="concat",
                        help="inplace: add a decoder step graph that writes the KV cache in place (export.kv_inplace)")
    parser.add_argument("--no-variant-check", action="store_true",
                        help="do not check the other weights variant (export.variants): the service will not offer it")
    args = parser.parse_args(argv)
    try:
        path = export_run(args.kind, args.checkpoint, args.repository, args.name, args.version, args.data_dir,
                          args.weights, args.attention, args.kv_cache)
        if not args.no_variant_check:
            version = ModelRepository(args.repository).get(path.parent.name, int(path.name))
            for weights, result in check_variants(version, args.data_dir).items():
                print(f"weights variant {describe_result(weights, result)}")
    except (FileNotFoundError, ValueError, DataError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ExportCheckError as error:
        print(f"check failed: {error}", file=sys.stderr)
        return 1
    print(f"exported {args.kind} to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
