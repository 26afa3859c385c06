"""What share of a translation its encoder pass is: all that caching a repeated source's encoder output could save
(docs/prefix_caching.md, "The translator").

    .venv/bin/python bench/encoder_share.py [--sentences 64] [--repeats 5]

The released translator on Multi30k validation sentences: the encoder pass alone and the whole translation (greedy
and beam 4, at most 40 new tokens), one sentence and 16 at a time, the best of `--repeats`; the CPU first.
"""

from __future__ import annotations

import argparse
import gzip
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpuinfo import describe  # noqa: E402
from service.decoding import BeamSearch  # noqa: E402
from service.decoding.greedy import GreedySearch  # noqa: E402
from service.engines.translation import TranslationEngine  # noqa: E402
from service.repository import ModelRepository  # noqa: E402

MAX_NEW_TOKENS = 40
BATCHES = (1, 16)
BEAMS = (1, 4)


def best_of(repeats: int, work: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    args = parser.parse_args(argv)
    print(describe())
    model = ModelRepository(args.repository).get("translation")
    engine = TranslationEngine(model)
    eos = model.config["special_tokens"]["eos_id"]
    with gzip.open(args.data_dir / "multi30k" / "val.de.gz", "rt") as lines:
        sources = [engine.source_ids(line.strip()) for line, _ in zip(lines, range(args.sentences))]
    for beams in BEAMS:
        def search(_: int):
            return BeamSearch(beams, MAX_NEW_TOKENS, eos) if beams > 1 else GreedySearch(MAX_NEW_TOKENS, eos)

        for batch in BATCHES:
            chunks = [sources[i : i + batch] for i in range(0, len(sources), batch)]
            encoder = best_of(args.repeats, lambda: [engine.encode(chunk) for chunk in chunks])
            whole = best_of(args.repeats, lambda: [engine.translate_ids(chunk, search) for chunk in chunks])
            print(f"translation {model.version} {'greedy' if beams == 1 else f'beam {beams}'} batch {batch}: encoder "
                  f"{encoder / len(chunks) * 1e3:.2f} ms, whole translation {whole / len(chunks) * 1e3:.1f} ms a batch, "
                  f"encoder share {encoder / whole:.1%}")


if __name__ == "__main__":
    main()
