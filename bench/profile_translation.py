"""Where a batch of beam-search translations spends its time: the release translator (or any translation version)
on the first test_2016_flickr sentences, with ONNX Runtime's share of the wall time and a digest of the outputs
(equal digests: the same translations, e.g. before and after a change to the search loop).

    .venv/bin/python bench/profile_translation.py [--repository model_repository] [--version N] [--batch 32]
        [--sentences 96] [--beams 4] [--data-dir ../shared/data] [--repeats 5] [--variant int8] [--operators]

First `--repeats` timed passes without a profiler: each ONNX Runtime call timed around it (`perf_counter`), the
medians of the wall time, of the time in ONNX Runtime and of the share outside it (the figure issue 23 sets a goal
for), with the CPU model and ISA; then one pass under cProfile for the functions that take the time outside (cProfile
over-counts Python a little, so its share is higher); with `--operators`, one more pass under ONNX Runtime's profiler,
its node times summed per operator type (encoder and decoder calls together). `--variant`: the weights variant
(service.engines.weights.VARIANTS; default: as stored), as TSERVE_VARIANT pins one.
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import hashlib
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))
from cpuinfo import describe as describe_cpu  # noqa: E402
from session_timing import operator_profile, timed_session_runs  # noqa: E402
from service.decoding import BeamSearch  # noqa: E402
from service.engines.runtime import RuntimeOptions  # noqa: E402
from service.engines.translation import TranslationEngine  # noqa: E402
from service.repository import ModelRepository  # noqa: E402

ORT_RUN = "onnxruntime_pybind11_state.run"  # ONNX Runtime's session run, as cProfile names the built-in
TOP_FUNCTIONS = 15
TOP_OPERATORS = 12


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--version", type=int, default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--sentences", type=int, default=96)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes without a profiler (0: none)")
    parser.add_argument("--variant", default=None, help="weights variant (default: as stored)")
    parser.add_argument("--operators", action="store_true", help="ONNX Runtime's node profile by operator type")
    args = parser.parse_args(argv)
    version = ModelRepository(args.repository).get("translation", args.version)
    options = RuntimeOptions(weights=args.variant)
    engine = TranslationEngine(version, options)
    path = args.data_dir / "multi30k" / "test_2016_flickr.de.gz"
    lines = gzip.open(path, "rt", encoding="utf-8").read().splitlines()[: args.sentences]
    sources = [engine.source_ids(line) for line in lines]

    def translate(engine: TranslationEngine) -> list[list[int]]:
        out = []
        for start in range(0, len(sources), args.batch):
            part = sources[start : start + args.batch]
            searches = engine.translate_ids(part, lambda i: BeamSearch(
                args.beams, engine.default_max_new_tokens(len(part[i])), engine.eos_id,
                length_penalty=engine.length_penalty))
            out += [search.results()[0].tokens for search in searches]
        return out

    translate(engine)  # warm-up
    print(describe_cpu())
    print(f"translation:{version.version} variant {args.variant or 'as stored'}")
    if args.repeats:
        walls, in_ort = [], []
        with timed_session_runs(_sessions(engine)) as ort_seconds:
            for _ in range(args.repeats):
                ort_seconds.clear()
                started = time.perf_counter()
                translate(engine)
                walls.append(time.perf_counter() - started)
                in_ort.append(sum(ort_seconds))
        shares = [1 - o / w for o, w in zip(in_ort, walls)]
        print(f"timed, {args.repeats} passes (medians): wall {statistics.median(walls):.3f} s "
              f"({len(sources) / statistics.median(walls):.1f} sentences/s), ONNX Runtime "
              f"{statistics.median(in_ort):.3f} s, outside it {100 * statistics.median(shares):.1f}% "
              f"(passes: {', '.join(f'{100 * x:.1f}' for x in shares)})")
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    outputs = translate(engine)
    profile.disable()
    wall = time.perf_counter() - started
    stats = pstats.Stats(profile)
    ort = sum(row[2] for key, row in stats.stats.items() if ORT_RUN in key[2])
    print(f"cProfile, {len(sources)} sentences, batch {args.batch}, beam {args.beams}: wall {wall:.3f} s, ONNX Runtime "
          f"{ort:.3f} s, outside it {100 * (1 - ort / wall):.0f}%")
    print("outputs", hashlib.sha1(repr(outputs).encode()).hexdigest())
    stats.sort_stats("tottime").print_stats(TOP_FUNCTIONS)
    if args.operators:
        with tempfile.TemporaryDirectory() as folder:
            profiled = TranslationEngine(version, replace(options, profile_prefix=f"{folder}/translation"))
            translate(profiled)
            by_operator, runs, run_us = operator_profile(_sessions(profiled))
        kernels = sum(by_operator.values())
        print(f"ONNX Runtime's profiler, {runs} runs: {run_us / 1e3:.1f} ms in session runs, {kernels / 1e3:.1f} ms in "
              "kernels")
        for op, us in sorted(by_operator.items(), key=lambda item: -item[1])[:TOP_OPERATORS]:
            print(f"  {op:28s} {us / 1e3:8.1f} ms  {100 * us / kernels:5.1f}%")
    return 0


def _sessions(engine: TranslationEngine) -> list:
    """Every ONNX Runtime session the engine may call."""
    return [engine.encoder, engine.decoder, getattr(engine._one_thread, "session", None),
            getattr(engine._in_place, "session", None)]


if __name__ == "__main__":
    sys.exit(main())
