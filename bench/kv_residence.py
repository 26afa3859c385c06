"""Where the decoders' KV caches should live on each provider: numpy on the host, bound by address, or OrtValues in
the provider's memory (`service.engines.device_cache`). `TSERVE_KV_RESIDENCE=auto` keeps the faster per provider.

    .venv/bin/python bench/kv_residence.py [--device cpu|cuda] [--rows 1,16,64] [--steps 64] [--rounds 3]

For the released GPT (greedy, its served variant's graphs) and translator (beam 4 over `--rows` // 4 sources, so
that every step reorders the beams): seconds per step of each residence, taking turns each round after an untimed
one, medians over the rounds, and the host bytes bound per step (`HostTransfers`); the CPU and provider first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpuinfo import describe  # noqa: E402
from service.engines.gpt import GPTEngine  # noqa: E402
from service.engines.runtime import DEFAULT_SINGLE_THREAD_ROWS, RuntimeOptions  # noqa: E402
from service.engines.translation import TranslationEngine  # noqa: E402
from service.repository import ModelRepository  # noqa: E402

RESIDENCES = ("host", "device")
BEAMS = 4
PROMPT = list(b"ROMEO:\nWhat say you to this?")
SOURCE = "Zwei Hunde spielen im Schnee auf einer Wiese."


def gpt_steps(engine: GPTEngine, rows: int, steps: int) -> float:
    """Seconds per greedy step of `rows` rows after the prompt pass."""
    logits, cache = engine.prefill([PROMPT] * rows)
    tokens = logits.argmax(-1)
    started = time.perf_counter()
    for _ in range(steps):
        tokens = engine.step(cache, tokens).argmax(-1)
    return (time.perf_counter() - started) / steps


def beam_steps(engine: TranslationEngine, rows: int, steps: int) -> float:
    """Seconds per step of `rows` // BEAMS sources' beams, each step reordering the rows (the best parents)."""
    sources = [engine.source_ids(SOURCE)] * max(1, rows // BEAMS)
    first, batch = engine.prefill(sources, candidates=BEAMS)
    batch = engine.select(batch, np.repeat(np.arange(len(sources)), BEAMS))
    tokens = first.top_ids[:, :BEAMS].reshape(-1)
    started = time.perf_counter()
    for _ in range(steps):
        out = engine.step(batch, tokens, candidates=BEAMS)
        parents = np.arange(batch.rows).reshape(-1, BEAMS)[:, [1, 0, 2, 3]].reshape(-1)  # two beams swap parents
        tokens = out.top_ids[parents, 0]
        batch = engine.select(batch, parents)
    return (time.perf_counter() - started) / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", default=str(ROOT / "model_repository"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    repository = ModelRepository(args.repository)
    print(describe())
    cases = {"gpt": (GPTEngine, gpt_steps), "translation": (TranslationEngine, beam_steps)}
    for name, (engine_class, run) in cases.items():
        model = repository.get(name)
        engines = {r: engine_class(model, RuntimeOptions(device=args.device, kv_residence=r,
                                                         single_thread_rows=DEFAULT_SINGLE_THREAD_ROWS[name]))
                   for r in RESIDENCES}
        print(f"{name} {model.version} on {engines['host'].provider}")
        for rows in map(int, args.rows.split(",")):
            times = {r: [] for r in RESIDENCES}
            for round_ in range(args.rounds + 1):
                for residence, engine in engines.items():
                    seconds = run(engine, rows, args.steps)
                    if round_:
                        times[residence].append(seconds)
            median = {r: statistics.median(t) for r, t in times.items()}
            moved = {r: e.transfers for r, e in engines.items()}
            print(f"  rows {rows:3d}: host {median['host'] * 1e3:7.3f} ms/step, device {median['device'] * 1e3:7.3f}"
                  f" ms/step, device/host time {median['device'] / median['host']:.2f}; host bytes bound per step: "
                  + ", ".join(f"{r} kv {t.kv_bytes // max(1, t.steps):,} other {t.other_bytes // max(1, t.steps):,}"
                              for r, t in moved.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
