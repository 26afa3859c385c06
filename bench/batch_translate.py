"""Issue 57's batch goal: `python -m service.batch --text` (the service's app in-process) against CTranslate2's
`translate_file`, German text file in, English text file out, on the same weights, in sentences per second.

    .venv-bench/bin/python bench/batch_translate.py [--rounds 3] [--tokens 24]   (make bench-engine's venv)

- Weights: bench-http's random-weight translator (bench/httpbench/repository.py, the release preset's size, in the
  variant the release translator is shipped in), the same model converted by bench/enginebench/ct2.py for
  CTranslate2, float32 and int8.
- Text: Multi30k test_2016's 1,000 German sentences (TSERVE_DATA_DIR). Random weights never end a sentence where a
  trained model would, so every translation is pinned to `--tokens` tokens on both sides (min = max decoding
  length), beam 4, length penalty 1: the same work for each system.
- Ours: the CLI as a user runs it (`.venv/bin/python -m service.batch --text ... -O num_beams=4 ...`), its own
  summary's lines/s (the job, not the models' load). CTranslate2: `Translator.translate_file` with the tokenizer as
  `source_tokenize_fn` / `target_detokenize_fn` (text in, text out, as ours), timed around the call, its defaults
  otherwise (batches of 32 examples, sorted by length within its read batches).
- `--rounds` interleaved rounds; each ratio printed with its spread (bench/spread.py). One machine, nothing else
  running.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(ROOT), str(BENCH)]

from cpuinfo import describe  # noqa: E402
from spread import ratio_spread, spread_text  # noqa: E402

SERVING_PYTHON = ROOT / ".venv" / "bin" / "python"
SUMMARY = re.compile(r"service\.batch: (\d+) lines in [\d.]+ s \(([\d.]+) lines/s")
BEAMS = 4
CT2_TYPES = ("float32", "int8")


def ours(repository: Path, source: Path, workdir: Path, tokens: int, threads: int, variant: str) -> float:
    """Sentences per second of `python -m service.batch --text` on `source` (its summary line)."""
    out = workdir / "ours.en"
    env = {**os.environ, "TSERVE_REPOSITORY": str(repository), "TSERVE_MODELS": "translation",
           "TSERVE_VARIANT": variant, "TSERVE_INTRA_OP_THREADS": str(threads), "TSERVE_CALIBRATION_CACHE": ""}
    command = [str(SERVING_PYTHON), "-m", "service.batch", "--text", "-i", str(source), "-o", str(out),
               "--overwrite", "--progress", "off", "-O", f"num_beams={BEAMS}", "-O", "length_penalty=1.0",
               "-O", f"min_new_tokens={tokens}", "-O", f"max_new_tokens={tokens}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    match = SUMMARY.search(done.stderr)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"service.batch failed ({done.returncode}): {done.stderr[-2000:]}")
    return float(match.group(2))


def ctranslate2(folder: Path, version: Path, source: Path, workdir: Path, compute_type: str, tokens: int,
                threads: int) -> float:
    """Sentences per second of CTranslate2's translate_file on `source`, text in and text out, tokenized as the
    service's translator reads a source (`TranslationEngine.source_ids`: the ids, then the end-of-source token)."""
    import json

    import ctranslate2 as ct2
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(version / "tokenizer.json"))
    eos = str(json.loads((version / "config.json").read_text())["special_tokens"]["eos_id"])
    translator = ct2.Translator(str(folder), device="cpu", compute_type=compute_type, intra_threads=threads,
                                inter_threads=1)
    sentences = sum(1 for _ in source.open(encoding="utf-8"))
    started = time.perf_counter()
    translator.translate_file(str(source), str(workdir / f"ct2-{compute_type}.en"), beam_size=BEAMS,
                              length_penalty=1.0, min_decoding_length=tokens, max_decoding_length=tokens,
                              source_tokenize_fn=lambda text: [str(i) for i in tokenizer.encode(text).ids] + [eos],
                              target_detokenize_fn=lambda ids: tokenizer.decode([int(i) for i in ids]))
    return sentences / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=24, help="tokens per translation, pinned")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--variant", default="stored", help="TSERVE_VARIANT of ours (default: the shipped graph)")
    parser.add_argument("--workdir", type=Path, default=ROOT / ".cache" / "bench_http")
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("TSERVE_DATA_DIR", ROOT / "data")))
    args = parser.parse_args()
    print(describe(), flush=True)
    from enginebench import ct2 as converter
    from httpbench.repository import build_repository, random_model

    from models import data

    repository = build_repository(args.workdir, args.data_dir, args.threads)
    pairs = data.load_multi30k(args.data_dir, "test_2016_flickr")
    source = args.workdir / "batch-translate.de"
    source.write_text("".join(" ".join(de.split()) + "\n" for de, _ in pairs), encoding="utf-8")
    model = random_model("translation")
    folders = {t: converter.convert(model, args.workdir / "peers" / f"ct2-batch-{t}", None if t == "float32" else t)
               for t in CT2_TYPES}
    version = repository / "translation" / "1"
    rates: dict[str, list[float]] = {"ours": [], **{t: [] for t in CT2_TYPES}}
    for round_ in range(args.rounds):
        rates["ours"].append(ours(repository, source, args.workdir, args.tokens, args.threads, args.variant))
        for t in CT2_TYPES:
            rates[t].append(ctranslate2(folders[t], version, source, args.workdir, t, args.tokens,
                                        args.threads))
        print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.1f} sentences/s" for k, v in rates.items()),
              flush=True)
    print(f"{len(pairs)} sentences, beam {BEAMS}, {args.tokens} tokens each, {args.threads} threads")
    for t in CT2_TYPES:
        spread = ratio_spread(rates["ours"], rates[t])
        print(f"service.batch / CTranslate2 translate_file {t} = {spread['median']:.2f}   (issue 57 goal >= 1.0)")
        print(f"  {spread_text(spread)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
