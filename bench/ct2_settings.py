"""Why CTranslate2 int8 is slow at batch 1 (issue 56, part 2): its translation speed on the engine benchmark's
translator (bench/enginebench/ct2.py, random weights, beam 4, 30 tokens pinned) under each of its own settings, one
fresh process per setting, so that a user's configuration can be told apart from the library's kernels.

    .venv-bench/bin/python bench/ct2_settings.py [--batches 1,16] [--rounds 3] [--seconds 4]

Settings varied (CTranslate2's documented knobs): compute_type (int8, int8_float32, float32), intra_threads (1, the
cores), CT2_USE_MKL (its GEMM backend: Intel MKL, chosen by default on Intel CPUs only, else oneDNN),
CT2_USE_EXPERIMENTAL_PACKED_GEMM, CT2_FORCE_CPU_ISA, OMP_WAIT_POLICY. Each process prints CT2_VERBOSE's backend
lines once; rounds are interleaved over the settings and each setting's median sentences/s is printed with its
rounds' range. Findings: docs/benchmarks.md, "CTranslate2 at batch 1".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(ROOT), str(BENCH)]

from cpuinfo import describe  # noqa: E402

# (label, compute_type, intra_threads or None for the cores, extra environment)
SETTINGS = [
    ("float32", "float32", None, {}),
    ("float32, 1 thread", "float32", 1, {}),
    ("int8", "int8", None, {}),
    ("int8, 1 thread", "int8", 1, {}),
    ("int8_float32", "int8_float32", None, {}),
    ("int8, CT2_USE_MKL=0 (oneDNN)", "int8", None, {"CT2_USE_MKL": "0"}),
    ("int8, CT2_USE_MKL=1", "int8", None, {"CT2_USE_MKL": "1"}),
    ("int8, packed GEMM", "int8", None, {"CT2_USE_EXPERIMENTAL_PACKED_GEMM": "1"}),
    ("int8, OMP_WAIT_POLICY=PASSIVE", "int8", None, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ("int8, CT2_FORCE_CPU_ISA=AVX512", "int8", None, {"CT2_FORCE_CPU_ISA": "AVX512"}),
    ("float32, CT2_USE_MKL=0 (oneDNN)", "float32", None, {"CT2_USE_MKL": "0"}),
]

CHILD = r"""
import json, sys, time
import numpy as np
import ctranslate2
sys.path[:0] = [{root!r}, {bench!r}]
from enginebench.workloads import TranslationSpec, make_sources, source_rows
folder, compute_type, threads, batch, seconds = {folder!r}, {compute_type!r}, {threads}, {batch}, {seconds}
spec = TranslationSpec()
translator = ctranslate2.Translator(folder, device="cpu", compute_type=compute_type, intra_threads=threads,
                                    inter_threads=1)
sources = [source_rows(s)[0] for s in make_sources(spec, 64)]
def run(rows):
    translator.translate_batch([[str(t) for t in r] for r in rows], beam_size=spec.num_beams, length_penalty=1.0,
                               max_decoding_length=spec.new_tokens, min_decoding_length=spec.new_tokens)
run(sources[:batch])  # warm-up
done, started, i = 0, time.perf_counter(), 0
while time.perf_counter() - started < seconds:
    rows = [sources[(i + j) % len(sources)] for j in range(batch)]
    run(rows); done += batch; i += batch
print(json.dumps({{"sentences_per_s": done / (time.perf_counter() - started)}}))
"""


def model_folder(workdir: Path, quantization: str | None) -> Path:
    """The engine benchmark's translator converted for CTranslate2 (bench/enginebench/ct2.py), once per folder."""
    from enginebench.ct2 import convert
    from enginebench.ours import translation_config
    from enginebench.workloads import TranslationSpec, seed_torch
    from models.transformer import EncoderDecoderTransformer

    seed_torch(0)
    model = EncoderDecoderTransformer(translation_config(TranslationSpec())).eval()
    return convert(model, workdir / f"ct2-{quantization or 'float32'}", quantization)


def measure(folder: Path, compute_type: str, threads: int, batch: int, seconds: float, extra: dict,
            verbose: bool) -> tuple[float, str]:
    """Sentences/s of one fresh CTranslate2 process; and its CT2_VERBOSE lines when `verbose`."""
    env = {**os.environ, **extra, "CT2_VERBOSE": "1" if verbose else "0"}
    if "OMP_WAIT_POLICY" not in extra:
        env.pop("OMP_WAIT_POLICY", None)
    code = CHILD.format(root=str(ROOT), bench=str(BENCH), folder=str(folder), compute_type=compute_type,
                        threads=threads, batch=batch, seconds=seconds)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    lines = [line.split("[info]")[-1] for line in done.stderr.splitlines() if "[ctranslate2]" in line]
    return json.loads(done.stdout.strip().splitlines()[-1])["sentences_per_s"], "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--only", default="", help="comma-separated labels' prefixes to keep")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    print(describe())
    settings = [s for s in SETTINGS if not args.only or any(s[0].startswith(p) for p in args.only.split(","))]
    with tempfile.TemporaryDirectory() as tmp:
        folders = {None: model_folder(Path(tmp), None), "int8": model_folder(Path(tmp), "int8")}
        for batch in (int(b) for b in args.batches.split(",")):
            speeds: dict[str, list[float]] = {label: [] for label, *_ in settings}
            for round_ in range(args.rounds):
                for label, compute_type, threads, extra in settings:
                    folder = folders["int8" if compute_type.startswith("int8") else None]
                    speed, verbose = measure(folder, compute_type, threads or cores, batch, args.seconds, extra,
                                             verbose=round_ == 0 and batch == 1)
                    if verbose:
                        print(f"--- {label}\n{verbose}")
                    speeds[label].append(speed)
            print(f"\nbatch {batch}, beam 4, sentences/s, median of {args.rounds} (min-max):")
            for label, values in speeds.items():
                print(f"  {label:36s} {statistics.median(values):8.1f}  ({min(values):.1f}-{max(values):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
