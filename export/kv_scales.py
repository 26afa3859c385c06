"""The int8 KV cache's scales of a GPT version (`service.engines.kv_quantization`): max |key| and max |value| per
layer, head and channel over windows of the training text and of random tokens, through the version's own prompt
graph as stored, / 127. The random windows cover what a user may send that the text never has (any byte): on the
release GPT they raise 8% of the channels' ranges (at most 1.47x) and leave the validation loss where it was
(1.3769 on 40k tokens either way; logits within 0.19 of the float32 cache's on random bytes, 0.14 on text).

    python -m export.kv_scales --repository DIR --name NAME [--version N] [--data-dir DIR]

Written beside the graphs (`kv_quantization.SCALES_FILE`) and described in config.json `kv_cache_scales`; a version
without them offers no `+gqa+kv8` variant. `export.variants` measures them (when missing) before it checks those
variants against the card, on the validation text: the scales never see it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from export.repository import version_tokenizer
from models import data
from models.datasets import DataError
from service.engines.kv_quantization import SCALES_FILE, scales_from_peaks
from service.repository import CONFIG_FILE, ModelRepository, ModelVersion, RepositoryError

CALIBRATION_WINDOWS = 128  # windows of the context length, spread evenly over the training text
RANDOM_WINDOWS = 32  # windows of uniformly random token ids (seeded)
RANDOM_SEED = 0
WINDOWS_PER_PASS = 16
CONFIG_KEY = "kv_cache_scales"


def measure_peaks(engine, ids: np.ndarray, windows: int = CALIBRATION_WINDOWS) -> np.ndarray:
    """Max |x| of the prompt pass's keys and values (layers, 2, heads, head_dim) through `engine` (a GPTEngine as
    stored: float32 presents) over `windows` windows of the context length taken evenly from `ids`."""
    length = min(engine.context_length, len(ids))
    starts = np.linspace(0, len(ids) - length, windows).astype(int)
    peaks = np.zeros((engine.n_layers, 2, engine.n_heads, engine.head_dim), np.float32)
    for first in range(0, len(starts), WINDOWS_PER_PASS):
        prompts = [ids[s : s + length].tolist() for s in starts[first : first + WINDOWS_PER_PASS]]
        _, cache = engine.prefill(prompts)
        for layer, arrays in enumerate(zip(cache.keys, cache.values)):
            for kind, array in enumerate(arrays):  # (rows, heads, slots, head_dim)
                np.maximum(peaks[layer, kind], np.abs(array).max(axis=(0, 2)), out=peaks[layer, kind])
    return peaks


def calibration_peaks(version: ModelVersion, text_ids: np.ndarray | None) -> np.ndarray:
    """The peaks over `RANDOM_WINDOWS` windows of random tokens and, when given, `CALIBRATION_WINDOWS` windows of
    `text_ids`, through the version's prompt graph as stored."""
    from service.engines.gpt import GPTEngine

    engine = GPTEngine(version)
    random_ids = np.random.default_rng(RANDOM_SEED).integers(0, engine.vocab_size,
                                                             RANDOM_WINDOWS * engine.context_length)
    peaks = measure_peaks(engine, random_ids, RANDOM_WINDOWS)
    return peaks if text_ids is None else np.maximum(peaks, measure_peaks(engine, text_ids))


def save_scales(version: ModelVersion, peaks: np.ndarray, data: str) -> dict:
    """Write the scales of `peaks` beside the graphs and describe them (measured on `data`) in config.json;
    returns that description."""
    np.save(version.path / SCALES_FILE, scales_from_peaks(peaks))
    described = {"file": SCALES_FILE, "shape": "layers, keys/values, heads, head_dim", "data": data,
                 "rule": "max |x| per channel / 127, through the stored prompt graph",
                 "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    config = json.loads((version.path / CONFIG_FILE).read_text())
    config[CONFIG_KEY] = described
    (version.path / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    version.config[CONFIG_KEY] = described
    return described


def write_scales(version: ModelVersion, data_dir: str | None = None) -> dict:
    """Measure the scales on the training text and random tokens, write them beside the graphs and describe them in
    config.json; returns that description."""
    train_text, _ = data.load_shakespeare(data.resolve_data_dir(data_dir))
    ids = np.asarray(version_tokenizer(version).encode(train_text).ids, dtype=np.int64)
    length = version.config["context_length"]
    return save_scales(version, calibration_peaks(version, ids),
                       f"tinyshakespeare training text: {CALIBRATION_WINDOWS} windows of {length} tokens; "
                       f"{RANDOM_WINDOWS} windows of random tokens (seed {RANDOM_SEED})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.kv_scales", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=Path("model_repository"), help="model repository root")
    parser.add_argument("--name", required=True, help="a GPT model's name in the repository")
    parser.add_argument("--version", type=int, default=None, help="default: the highest")
    parser.add_argument("--data-dir", default=None, help="where tinyshakespeare is (default: TSERVE_DATA_DIR)")
    args = parser.parse_args(argv)
    try:
        version = ModelRepository(args.repository).get(args.name, args.version)
        if version.kind != "gpt":
            raise ValueError(f"{args.name} is a {version.kind} model: only a GPT has a KV cache to quantise")
        described = write_scales(version, args.data_dir)
    except (RepositoryError, DataError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(described, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
