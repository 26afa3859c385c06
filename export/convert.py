"""Derive a graph variant of a version already in the repository, from its ONNX files alone (no checkpoint needed).

    python -m export.convert --repository DIR --name NAME --from-version 1 --to-version 2 [--weights int8]
        [--attention mha] [--kv-cache inplace] [--data-dir DIR]

Copies DIR/NAME/<from>/, rewrites its graphs as `python -m export` does (`export.repository.rewrite_graphs`:
attention fusion first, then the weight storage, then the in-place step graph), and measures the new graphs on
the data the source card was measured on (the full sets for the release models; `export.repository.check_quality`):
GPT validation loss, ViT test accuracy, translation sacreBLEU with beam 4 through the service. Each must stay
within `export.tolerances` of the source card's float32 (PyTorch) figure. The greedy outputs (ViT: argmax) on the parity
inputs are compared with the source version's and recorded as "n/N identical". The version is built in a
temporary sibling and renamed into place only when every check passed, with config.json (`weights`, `attention`,
`kv_cache`, `derived_from`) and a model card saying what was measured, against what, by which command. Exit
status: 0 written, 1 a check failed (nothing written), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from export.checks import ExportCheckError
from export.repository import (
    ATTENTION,
    KV_CACHE,
    KV_INPLACE_NOTE,
    WEIGHTS,
    check_quality,
    greedy_outputs,
    rewrite_graphs,
    same_outputs,
    version_tokenizer,
)
from export.tolerances import TOLERANCES
from models.datasets import DataError
from service.repository import CONFIG_FILE, ModelRepository, ModelVersion, RepositoryError

PARITY_INPUTS = {"gpt": "50 validation prompts", "translation": "50 validation sentences",
                 "vit": "the first 1,000 test images"}


def _demoted(card: str) -> list[str]:
    """The source card without its title, its headings one level down, to sit inside the new card."""
    lines = card.splitlines()[1:]
    while lines and not lines[0].strip():
        lines.pop(0)
    return ["#" + line if line.startswith("#") else line for line in lines]


def _conversion_card(name: str, version: int, config: dict, conversion: dict, source_card: str) -> str:
    quality = conversion["quality"]
    source = conversion["from_version"]
    lines = [f"# {name} version {version}", "",
             (f"Derived from version {source} without retraining: its graphs with weights `{config['weights']}` "
              f"and attention `{config['attention']}`, made by"), "", f"    {conversion['command']}", ""]
    if "weights_storage" in config:
        lines += [f"Weight storage: {config['weights_storage']}.", ""]
    if config["attention"] == "mha":
        lines += ["Attention: fused into ONNX Runtime's contrib MultiHeadAttention (`export.attention_fusion`).", ""]
    if config.get("kv_cache") == "inplace":
        lines += [f"KV cache: {KV_INPLACE_NOTE}.", ""]
    lines += [f"## Conversion checks (this version vs the float32 model of version {source}'s card)", "",
              "| check | result |", "| --- | --- |",
              f"| {quality['metric']} of this version | {quality['measured']} |",
              f"| {quality['metric']} on version {source}'s card (PyTorch, float32) | {quality['reference']} |",
              f"| delta | {quality['delta']:+} (tolerance {quality['tolerance']}) |",
              f"| measured on | {quality['data']} |",
              (f"| same {conversion['output']} as version {source} on {PARITY_INPUTS[config['kind']]} | "
               f"{conversion['same_as_source']} |")]
    lines += [f"| {key.replace('_', ' ')} | {value} |" for key, value in conversion["graphs"].items()]
    lines += ["", f"## Version {source}'s card", ""] + _demoted(source_card) + [""]
    return "\n".join(lines)


def convert(repository: Path, name: str, from_version: int, to_version: int, weights: str = "fp32",
            attention: str = "plain", data_dir: str | None = None, tolerances: dict[str, float] = TOLERANCES,
            command: str = "", kv_cache: str = "concat") -> Path:
    """Write DIR/name/to_version/, the rewritten copy of from_version; raises `ExportCheckError` (nothing written)
    when the quality leaves the tolerance, ValueError/RepositoryError on bad arguments."""
    if (weights, attention, kv_cache) == ("fp32", "plain", "concat"):
        raise ValueError("nothing to convert: ask for --weights int8/fp16, --attention mha and/or --kv-cache inplace")
    source = ModelRepository(repository).get(name, from_version)
    final = Path(repository) / name / str(to_version)
    if final.exists():
        raise ValueError(f"{final} already exists; pick another --to-version")
    staging = Path(tempfile.mkdtemp(prefix=f".{to_version}-", dir=final.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; servers may run as another user
    try:
        shutil.copytree(source.path, staging, dirs_exist_ok=True)
        config = {**source.config, "version": to_version}
        graphs = rewrite_graphs(staging, config, weights, attention, kv_cache)
        config.update({"derived_from": from_version,
                       "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        staged = ModelVersion(name, to_version, staging, config)
        kind, tokenizer = source.kind, version_tokenizer(source)
        card = json.loads((source.path / "metrics.json").read_text())
        quality = check_quality(kind, staged, tokenizer, card, data_dir, tolerances)
        same = same_outputs(greedy_outputs(kind, source, tokenizer, data_dir),
                            greedy_outputs(kind, staged, tokenizer, data_dir))
        conversion: dict[str, Any] = {
            "from_version": from_version, "weights": weights, "attention": attention, "kv_cache": kv_cache,
            "command": command or f"python -m export.convert --name {name} --from-version {from_version} ...",
            "quality": quality, "output": "argmax" if kind == "vit" else "greedy output", "same_as_source": same,
            "graphs": graphs}
        (staging / "metrics.json").write_text(json.dumps({**card, "conversion": conversion}, indent=2))
        source_card = (source.path / "README.md").read_text() if (source.path / "README.md").exists() else ""
        (staging / "README.md").write_text(_conversion_card(name, to_version, config, conversion, source_card))
        staging.rename(final)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, required=True, help="model repository root")
    parser.add_argument("--name", required=True, help="model name in the repository")
    parser.add_argument("--from-version", type=int, required=True)
    parser.add_argument("--to-version", type=int, required=True)
    parser.add_argument("--weights", choices=WEIGHTS, default="fp32",
                        help="int8: 8-bit MatMul weights, ONNX Runtime's MatMulNBits (export.quantize)")
    parser.add_argument("--attention", choices=ATTENTION, default="plain",
                        help="mha: fuse attention into ONNX Runtime's contrib MultiHeadAttention")
    parser.add_argument("--kv-cache", choices=KV_CACHE, default="concat",
                        help="inplace: add a decoder step graph that writes the KV cache in place (export.kv_inplace)")
    parser.add_argument("--data-dir", default=None, help="data for the quality checks (default: $TSERVE_DATA_DIR)")
    args = parser.parse_args(argv)
    command = shlex.join(["python", "-m", "export.convert", *(sys.argv[1:] if argv is None else argv)])
    try:
        path = convert(args.repository, args.name, args.from_version, args.to_version, args.weights,
                       args.attention, args.data_dir, command=command, kv_cache=args.kv_cache)
    except (FileNotFoundError, ValueError, DataError, RepositoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ExportCheckError as error:
        print(f"check failed: {error}", file=sys.stderr)
        return 1
    print(json.dumps(json.loads((path / "metrics.json").read_text())["conversion"], indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
