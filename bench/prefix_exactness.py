"""Whether the GPT's prompt pass over a suffix, after the K/V of the prompt's start, gives the whole prompt's numbers:
the property a prefix cache's outputs rest on (`service.engines.prefix_pass`).

    .venv/bin/python bench/prefix_exactness.py [--prompts 40] [--variants fp32,int8]

For Shakespeare prompts of 20-240 tokens from the validation text, one row each: the whole prompt's pass vs a pass
over its start and then one over its last S tokens after the start's presents, for each S of `SUFFIXES`: how many
prompts differ anywhere (logits at the suffix positions or any K/V slot), and the largest |difference|. The CPU
first. The service caches whole 16-token blocks and leaves at least 2 tokens to compute (S >= 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpuinfo import describe  # noqa: E402
from service.engines.gpt import GPTEngine  # noqa: E402
from service.engines.runtime import RuntimeOptions  # noqa: E402
from service.repository import ModelRepository  # noqa: E402

SUFFIXES = (1, 2, 3, 7, 16, 33)
SHORTEST, LONGEST = 20, 240
SEED = 55


def shakespeare(data_dir: Path) -> str:
    sys.path.insert(0, str(ROOT))
    from models.data import load_shakespeare

    return load_shakespeare(data_dir)[1]


def differences(engine: GPTEngine, prompt: list[int], suffix: int) -> float:
    """The largest |difference| between the whole pass and start + suffix passes (logits and every K/V slot)."""
    start = len(prompt) - suffix
    whole_logits, whole = engine._prompt_pass([prompt])
    _, prefix = engine._prompt_pass([prompt[:start]])
    logits, presents = engine._prompt_pass([prompt[start:]], list(prefix))
    gaps = [np.abs(whole_logits[0, start:] - logits[0]).max()]
    gaps += [np.abs(w[0] - p[0]).max() for w, p in zip(whole, presents)]
    return float(max(gaps))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--variants", default="fp32,int8")
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    args = parser.parse_args(argv)
    print(describe())
    text = shakespeare(args.data_dir)
    model = ModelRepository(args.repository).get("gpt")
    for variant in args.variants.split(","):
        engine = GPTEngine(model, RuntimeOptions(weights=variant))
        rng = np.random.default_rng(SEED)
        for suffix in SUFFIXES:
            differing, largest = 0, 0.0
            for _ in range(args.prompts):
                begin = int(rng.integers(0, len(text) - 4 * LONGEST))
                length = int(rng.integers(max(SHORTEST, suffix + 1), LONGEST))
                prompt = engine.tokenizer.encode(text[begin : begin + 2 * length]).ids[:length]
                gap = differences(engine, prompt, suffix)
                differing += gap != 0
                largest = max(largest, gap)
            print(f"gpt {model.version} {variant}: suffix of {suffix:2d} tokens: {differing}/{args.prompts} prompts "
                  f"differ, max |difference| {largest:.3g}")


if __name__ == "__main__":
    main()
