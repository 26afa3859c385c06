"""Check the weights variants a version does not store, so that the service may run them: the variants are derived
when the graphs load (`service.engines.weights`), and offered only once checked here (`service.models.variants`).

    python -m export.variants --repository DIR --name NAME [--version N] [--data-dir DIR] [--variants V,...]

For each variant other than the stored one (`service.engines.weights.VARIANTS`: int8 <-> fp32 weights, and with an
in-place step graph each of them with its attention as GroupQueryAttention, `+gqa`, and over an int8 KV
cache, `+gqa+kv8`), the version is measured in that
variant, derived exactly as the service derives it, on the data its card was measured on
(`export.repository.check_quality`: GPT validation loss, through the decoding steps for a `+gqa` variant, ViT test
accuracy, translation sacreBLEU with beam 4 through the service with the variant pinned) and held to
`export.tolerances` of the card's float32 (PyTorch) figure, as an exported int8 graph is. A variant within it is
written into config.json `variants` (variant -> what was measured), the list the service chooses from; every
result, passed or not, goes into metrics.json (`export_checks`, `<variant>_weights_variant`) and the model card's
"Weights variants" section. Nothing is stored twice: the graphs on disk are not touched. `python -m export` runs
this after every export.

Exit status: 0 every variant checked (passed or not, recorded), 2 bad arguments or missing data.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from export.checks import ExportCheckError
from export.kv_scales import write_scales
from export.repository import check_quality, version_tokenizer
from models.datasets import DataError
from service.engines.kv_quantization import SCALES_FILE
from service.engines.onnx_graph import load
from service.engines.step_attention import has_masked_step_attention
from service.engines.weights import VARIANTS, changes_step_attention, compute_weights, quantizes_kv_cache
from service.repository import CONFIG_FILE, ModelRepository, ModelVersion, RepositoryError

METRICS_FILE, CARD_FILE = "metrics.json", "README.md"
CARD_SECTION = "## Weights variants"
VARIANT_CHECK_SUFFIX = "_weights_variant"  # metrics.json `export_checks`: <variant>_weights_variant -> the result


def candidate_variants(version: ModelVersion) -> list[str]:
    """The variants `version` may run besides its stored one: the other weights, and the `+gqa` ones only where it
    has an in-place step graph with masked attention to rewrite."""
    stored = compute_weights(version.config.get("weights", "fp32"))
    step = version.config["files"].get("decoder_step")
    rewritable = step is not None and has_masked_step_attention(load(version.path / step))
    return [v for v in VARIANTS if v != stored and (rewritable or not changes_step_attention(v))]


def check_variants(version: ModelVersion, data_dir: str | None = None,
                   only: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Measure every variant `version` does not store (`candidate_variants`, or those of them named in `only`, the
    results of the others kept as recorded; first the int8 KV cache's scales, `export.kv_scales`, where a `+gqa+kv8`
    variant needs them and the version has none), and record the results in its folder (config.json, metrics.json,
    README.md); returns variant -> result (`check_quality`'s, with `passed`, and the failure's message where it
    failed) of the variants measured."""
    stored = compute_weights(version.config.get("weights", "fp32"))
    card = json.loads((version.path / METRICS_FILE).read_text())
    tokenizer = version_tokenizer(version)
    results: dict[str, dict[str, Any]] = {}
    candidates = candidate_variants(version)
    if only is not None:
        unknown = sorted(set(only) - set(candidates))
        if unknown:
            raise ValueError(f"not a variant {version.name}:{version.version} can run besides its stored one: "
                             f"{', '.join(unknown)} (candidates: {', '.join(candidates)})")
        candidates = [v for v in candidates if v in only]
    if any(quantizes_kv_cache(v) for v in candidates) and not (version.path / SCALES_FILE).is_file():
        write_scales(version, data_dir)  # the int8 cache's scales, from the training text
    for weights in candidates:
        try:
            result = {**check_quality(version.kind, version, tokenizer, card, data_dir, weights=weights),
                      "passed": True}
        except ExportCheckError as error:
            result = {"passed": False, "failure": str(error)}
        results[weights] = {"derived_from": stored, **result,
                            "checked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if only is None:  # a whole check: no earlier result stays
        checks = card.get("export_checks", {})
        for key in [k for k in checks if k.endswith(VARIANT_CHECK_SUFFIX)]:
            del checks[key]
    _record(version, card, stored, {**(_recorded(version) if only is not None else {}), **results})
    return results


def _recorded(version: ModelVersion) -> dict[str, dict[str, Any]]:
    """The variants an earlier check offered (config.json `variants`); its failures stay in metrics.json."""
    return {w: {**r, "passed": True} for w, r in version.config.get("variants", {}).items()}


def describe_result(weights: str, result: dict[str, Any]) -> str:
    if not result["passed"]:
        return f"{weights} (derived from {result['derived_from']}): not offered: {result['failure']}"
    return (f"{weights} (derived from {result['derived_from']} when the graphs load): {result['metric']} "
            f"{result['measured']} vs {result['reference']} (delta {result['delta']:+}, tolerance "
            f"{result['tolerance']}) on {result['data']}")


def _record(version: ModelVersion, card: dict, stored: str, results: dict[str, dict[str, Any]]) -> None:
    config = dict(version.config)
    config["variants"] = {w: {k: v for k, v in r.items() if k not in ("passed", "failure")}
                          for w, r in results.items() if r["passed"]}
    (version.path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    checks = card.setdefault("export_checks", {})
    for weights, result in results.items():
        checks[f"{weights}{VARIANT_CHECK_SUFFIX}"] = describe_result(weights, result)
    (version.path / METRICS_FILE).write_text(json.dumps(card, indent=2))
    readme = version.path / CARD_FILE
    if readme.exists():
        text = readme.read_text()
        head, _, rest = text.partition(f"\n{CARD_SECTION}\n")
        tail = rest.partition("\n## ")[2] if rest else ""
        section = [CARD_SECTION, "", f"Stored: {stored}. The others are "
                   "derived when the graphs load (`service.engines.weights`); the service runs the fastest offered "
                   "one on its host unless TSERVE_VARIANT pins one (`service.models.variants`). Checked by "
                   f"`python -m export.variants --name {version.name} --version {version.version}`:", ""]
        section += [f"- {line}" for key, line in checks.items() if key.endswith(VARIANT_CHECK_SUFFIX)]
        text = head.rstrip("\n") + "\n\n" + "\n".join(section) + "\n" + (f"\n## {tail}" if tail else "")
        readme.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.variants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=Path("model_repository"), help="model repository root")
    parser.add_argument("--name", required=True, help="model name in the repository")
    parser.add_argument("--version", type=int, default=None, help="default: the highest")
    parser.add_argument("--data-dir", default=None, help="the data the card was measured on (default: TSERVE_DATA_DIR)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated: check only these, keeping the others' recorded results (default: all)")
    args = parser.parse_args(argv)
    try:
        version = ModelRepository(args.repository).get(args.name, args.version)
        only = None if args.variants is None else [v.strip() for v in args.variants.split(",") if v.strip()]
        results = check_variants(version, args.data_dir, only)
    except (RepositoryError, DataError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for weights, result in results.items():
        print(describe_result(weights, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
