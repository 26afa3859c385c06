"""Engine benchmark: our ONNX Runtime decoding engine vs Hugging Face transformers, Optimum and ONNX Runtime GenAI,
on CPU, and our GPT engine's scaling with the batch against an fp32 matmul roofline.

What is compared, on same-size models with random weights (nothing is downloaded: every model is built from a
config, and the Optimum models are exported locally into --workdir):

- GPT (decoder-only), greedy, a 16-token prompt and exactly 128 new tokens, at batch 1 and batch 16 -> tokens/s.
  d_model 256, 4 layers, 4 heads, d_ff 1024, vocab 512, context 256 (`GPT2LMHeadModel` for the baselines).
- Translation (encoder-decoder), beam search with 4 beams, at batch 1 (sentences one at a time) and batch 16 and
  32 (one call of that many sentences, right-padded), sources of ~15 tokens (Multi30k length) and exactly 30 new
  tokens -> sentences/s. d_model 256, 3+3 layers, 4 heads, d_ff 1024, vocab 8,000
  (`MarianMTModel` for the baselines).

Systems (one function each, `run_<system>_<task>`):
- transformers: PyTorch `model.generate()`;
- optimum: `optimum.onnxruntime.ORTModelForCausalLM` / `ORTModelForSeq2SeqLM` (their own `generate()`);
- genai (GPT only): `onnxruntime_genai` (`Generator`, greedy) running OUR exported GPT graph, the very
  `decoder.onnx` our engine loads, unchanged, through a generated `genai_config.json` (bench/genai_system.py). Same
  graph and weights as ours, so its tokens must equal ours: the harness checks and reports it. It runs in this
  process (its wheel uses the installed onnxruntime package), timed and interleaved like the others;
- ctranslate2 (translation only): CTranslate2's `Translator` (C++) on OUR translator's weights, converted by
  `enginebench.ct2` into its `TransformerSpec` (the same random weights as ours, seed 0), beam search with the same
  beams and exactly as many tokens; its best beams are compared with ours every run ("identical best beams"), and
  each ratio is printed as `ours/ctranslate2 <case> = <x>`; ctranslate2-int8 the same model in its int8
  (`compute_type="int8"`: int8 weights and GEMMs), the peer of a shipped variant with int8 weights; both at the faster
  of 1 and --threads intra-op threads for each batch, timed in the warm-up (`enginebench.ct2.ThreadChoice`: on 2
  cores its batch 1 runs 2.3x faster on one thread) and printed as the case's `intra_threads` line;
- llama.cpp (GPT only; built by `make llama-cpp`, skipped until then): `llama-server` (C++) on OUR GPT's weights,
  written by `enginebench.llama_cpp` as a GGUF file of its `gpt2` architecture (the same random weights as ours,
  seed 0, f32, KV cache f32), greedy with EOS masked, all rows in one /completion request of token ids to a server
  with as many slots; each ratio is printed as `ours/llama.cpp b<batch> = <x>`. Its GELU is the tanh approximation
  (ours: erf), so the greedy tokens agree up to a near-tie: every run prints the identical sequences and tokens and
  where they first diverge ("agreement ours vs llama.cpp"). After each GPT case, llama.cpp's own benchmark,
  `llama-batched-bench`, on the same file and batch (`repeats` runs, the median; not interleaved; random tokens,
  nothing sampled, no HTTP) is a row of its own: its tokens/s with the prompt pass, its S_TG, and
  `ours/llama-batched-bench b<batch> = <x>`; llama.cpp-q8_0 the same server on the same weights written in
  llama.cpp's int8 format, q8_0 (the matmul weights in blocks of 32 with a scale each; norms, biases and positions
  f32), the peer of a shipped variant with int8 weights, printed as `shipped/llama.cpp-q8_0 b<batch> = <x>`, with
  llama-batched-bench's row on that file too (`shipped/llama-batched-bench-q8_0 b<batch> = <x>`);
- ours: `service.engines.gpt.GPTEngine` / `service.engines.translation.TranslationEngine` with the searches of
  `service.decoding`, on our own from-scratch models (`models.gpt.GPT`, `models.transformer`; same sizes,
  random weights) exported by `export.onnx_export`, float32;
- shipped: the same engine on the same export rewritten as the release model is stored (bench/shipped.py) and run
  in the weights variant the service runs on this host (`--shipped-variant auto`, the default: the choice of its
  start-up calibration for each release model, from `python -m service.models.calibrate --pins`; or a
  TSERVE_VARIANT value: `int8`, `gpt=int8+gqa,translation=stored`). Its outputs need not equal float32's (int8
  weights): "identical best beams shipped vs ctranslate2 float32" says how often they do.

Fairness rules:
- Every system generates exactly the same number of tokens: EOS is never chosen because every system gets
  `min_new_tokens == max_new_tokens` (HF/Optimum: the `MinNewTokensLengthLogitsProcessor` masks EOS until the
  last step; ours: the searches' `min_new_tokens`). The harness checks the output shapes.
- One thread count for all (`--threads`, default 2): `torch.set_num_threads` and every ONNX Runtime session's
  `intra_op_num_threads` (inter-op 1), and one spin policy: idle threads sleep instead of busy-waiting (torch:
  OMP_WAIT_POLICY=PASSIVE; ONNX Runtime: allow_spinning=0) unless --spin. See `Runtime`.
- Each system is warmed up before timing; the timed repeats are interleaved round-robin across systems (so a
  background load drifting over time hits them all alike) and the median is reported, each ratio with its spread
  over the rounds (bench/spread.py: FLAGGED above 1.3x) and issue 56's goal where it has one. Time includes the
  prompt pass (prefill / encoder), not the model build or export. Tokens/s counts generated tokens only.
- Compare ratios from one run, never absolute numbers from different runs: this machine is shared.

Scaling table (task `scaling`): our GPT engine at batch 1, 8, 16, 32, 64, 128 (--scaling-batches) on the release
GPT's shape (models/config.py, preset gpt/release: d_model 256, 6 layers, 4 heads, d_ff 1024, vocab 257, context
256; random weights), same prompt and new tokens as above, next to its fp32 roofline measured in the same run: the
matmuls of one decoding step at that batch (per layer the q, k, v and attention-output projections and the two
MLP matmuls, then the tied LM head; the model's nn.Linear shapes and op, F.linear, bias included) timed in torch
with the same threads, `new_tokens` steps per pass, interleaved with ours and converted to tokens/s
(batch * new_tokens / median seconds). Printed: tokens/s of both and ours' fraction of the roofline (= the time
torch needs for the step's matmuls / the time our whole step takes). The roofline leaves out the prompt pass,
attention over the cache, LayerNorm, GELU, the search and everything else. It is torch's (MKL's) matmul speed, not
a hardware bound: at small batches (8-16 rows) ONNX Runtime's own MatMul kernels (MLAS) can beat it, and the
fraction then comes out near or above 1.

Prefix-cache task (`prefix`, issue 55; bench/enginebench/prefix.py): our GPT engine as `shipped` runs it, on the
release shape, the prompt pass of a 200-token shared prefix + 16 tokens at batch 1 with its prefix cache (a hit, and
a miss: a prefix never seen) and without one -> ms per prompt pass and `prefix hit/miss`, `hit/off`, `miss/off`,
with the tokens each hit took from the cache and whether the hit's logits equal the cache-off engine's.

Run (in the benchmark venv, which has Optimum; see bench/requirements.txt):
    .venv-bench/bin/python bench/bench_engine.py --quick          # smoke run, 1-2 minutes once exports are cached
    .venv-bench/bin/python bench/bench_engine.py                  # full run, writes reports/bench_engine.json
    .venv-bench/bin/python bench/bench_engine.py --tasks prefix   # the prefix cache's prompt pass alone
Options: --device cpu|cuda (ours and shipped), --kv-residence auto|host|device (ours and shipped), --threads N,
--spin, --single-thread-rows N, --repeats N, --warmup N, --sentences N, --gpt-batches 1,16,
--translation-batches 1,16,32, --scaling-batches 1,8,16,32,64,128, --tasks gpt,translation,scaling,prefix, --systems
transformers,optimum,genai,ctranslate2,ctranslate2-int8,llama.cpp,llama.cpp-q8_0,ours,shipped, --out PATH,
--workdir PATH. A system whose package or build is missing (e.g. Optimum in the main venv, llama.cpp before
`make llama-cpp`) or that does not apply to a task (genai: translation) is reported as skipped, with the reason.
The CPU model and its ISA are printed first (bench/cpuinfo.py) and recorded in the report.

Code: this file (options, the run); bench/enginebench/: workloads.py (sizes, inputs, thread settings), baselines.py
(transformers, Optimum, GenAI), ct2.py (CTranslate2 on our weights), llama_cpp.py (llama.cpp on our GPT's weights),
ours.py (our engine, plain and shipped), systems.py (the systems by task), measure.py (interleaved timing, checks,
summaries), scaling.py (the scaling table), prefix.py (the prefix-cache task), report.py (printing, environment).
"""

from __future__ import annotations

import os

# Nothing may come from the Hugging Face hub: every model here is built locally from a config.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import logging
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
for folder in (PROJECT_ROOT, PROJECT_ROOT / "bench"):  # the project's packages, and enginebench
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from cpuinfo import describe as describe_cpu  # after the sys.path set-up
from enginebench.llama_cpp import SYSTEM_FILE_TYPES, add_batched_bench
from enginebench.measure import measure, summarise
from enginebench.prefix import bench_prefix
from enginebench.report import environment, print_result, print_table
from enginebench.scaling import bench_scaling, print_scaling
from enginebench.systems import SYSTEMS, build_systems
from enginebench.workloads import GptSpec, Runtime, TranslationSpec, make_prompts, make_source_batch, make_sources
from service.models.variants import AUTO, parse_pins
from shipped import served_variants

TASKS = ("gpt", "translation", "scaling", "prefix")  # scaling, prefix: `enginebench.scaling`, `enginebench.prefix`


def bench_gpt(args, systems: list[str]) -> list[dict]:
    spec = GptSpec()
    print(f"GPT: {spec}", flush=True)
    built, skipped = build_systems("gpt", spec, systems, args.runtime, args.workdir)
    results = []
    for batch in args.gpt_batches:
        prompts = make_prompts(spec, batch)
        case_skipped = dict(skipped)  # and the systems that cannot run this batch
        times, outputs = measure(built, [prompts], spec.new_tokens, args.warmup, args.repeats, case_skipped)
        results.append(summarise(f"gpt greedy batch {batch}", "tokens/s", batch * spec.new_tokens, times, outputs,
                                 case_skipped))
        results[-1]["batch"] = batch
        for system, file_type in SYSTEM_FILE_TYPES.items():
            if system in built:  # llama.cpp's own benchmark on the same GGUF: a row of its own, after the case
                add_batched_bench(results[-1], spec, args.runtime, args.workdir, batch, args.repeats, file_type)
        print_result(results[-1])
    return results


def bench_translation(args, systems: list[str]) -> list[dict]:
    spec = TranslationSpec()
    print(f"Translation: {spec}", flush=True)
    built, skipped = build_systems("translation", spec, systems, args.runtime, args.workdir)
    results = []
    for batch in args.translation_batches:
        # batch 1: --sentences sentences one at a time; batch B: one call of B sentences, right-padded
        inputs = make_sources(spec, args.sentences) if batch == 1 else [make_source_batch(spec, batch)]
        case_skipped = dict(skipped)  # and the systems that cannot run this batch
        times, outputs = measure(built, inputs, spec.new_tokens, args.warmup, args.repeats, case_skipped)
        work = sum(x.shape[0] for x in inputs)
        result = summarise(f"translation beam {spec.num_beams} batch {batch}", "sentences/s", work, times, outputs,
                           case_skipped)
        result["source_lengths"] = [int((row != 0).sum()) for x in inputs for row in x]
        # CTranslate2's thread setting for this batch, chosen in the warm-up (`enginebench.ct2.ThreadChoice`)
        result["intra_threads"] = {name: choice for name, fn in built.items()
                                   if (choice := getattr(fn, "thread_choices", {}).get(batch)) is not None}
        print_result(result)
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 warm-up, 2 repeats, 3 sentences")
    parser.add_argument("--threads", type=int, default=2, help="torch and ONNX Runtime intra-op threads (default 2)")
    parser.add_argument("--spin", action="store_true",
                        help="let idle threads busy-wait (library defaults); only on an otherwise idle machine")
    parser.add_argument("--single-thread-rows", type=int, default=None,
                        help="ours/shipped: steps of at most this many rows on a one-thread session (default: as the "
                             "service runs each model, service.models.kinds; 0: never)")
    parser.add_argument("--shipped-variant", default="auto",
                        help="shipped: the variant it runs, as TSERVE_VARIANT pins one, for every model (int8) or per "
                             "model (gpt=int8+gqa,translation=stored; fp32, int8, fp32+gqa, int8+gqa, stored); "
                             "auto (default): what the service's calibration chose on this host for each release "
                             "model (python -m service.models.calibrate --pins, bench/shipped.py)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="ours/shipped: the device of their ONNX Runtime sessions (default cpu; cuda fails the run "
                             "when the sessions fall back to CPU); the other systems run on CPU")
    parser.add_argument("--no-fuse-projections", dest="fuse_projections", action="store_false",
                        help="ours/shipped: run the graphs' sibling projections as separate MatMuls (the service "
                             "fuses them at load unless TSERVE_FUSE_PROJECTIONS=false)")
    parser.add_argument("--kv-residence", choices=("auto", "host", "device"), default="auto",
                        help="ours/shipped: where their KV caches live, as TSERVE_KV_RESIDENCE (default auto: the "
                             "service's own choice; device on a CPU: OrtValues fed back to ONNX Runtime as they came)")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes per system (default 7; quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed passes per system (default 2; quick 1)")
    parser.add_argument("--sentences", type=int, default=None,
                        help="translation: source sentences per pass, one at a time (default 10; quick 3)")
    parser.add_argument("--gpt-batches", default="1,16", help="GPT batch sizes (default 1,16)")
    parser.add_argument("--translation-batches", default="1,16,32",
                        help="translation batch sizes (default 1,16,32; 1: --sentences one at a time)")
    parser.add_argument("--scaling-batches", default="1,8,16,32,64,128",
                        help="scaling table batch sizes (default 1,8,16,32,64,128)")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated: gpt,translation,scaling,prefix")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated: {','.join(SYSTEMS)} (the scaling task always runs ours and "
                             "shipped)")
    parser.add_argument("--out", type=Path, default=Path("reports/bench_engine.json"), help="JSON results")
    parser.add_argument("--workdir", type=Path, default=Path(".cache/bench_engine"),
                        help="where exported models are kept between runs (default .cache/bench_engine)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 7)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    args.sentences = args.sentences or (3 if args.quick else 10)
    args.gpt_batches = [int(b) for b in args.gpt_batches.split(",") if b]
    args.translation_batches = [int(b) for b in args.translation_batches.split(",") if b]
    args.scaling_batches = [int(b) for b in args.scaling_batches.split(",") if b]
    tasks = [t for t in args.tasks.split(",") if t]
    systems = [s for s in args.systems.split(",") if s]
    for name in systems:
        if name not in SYSTEMS:
            parser.error(f"unknown system {name!r}; choose from {SYSTEMS}")
    for task in tasks:
        if task not in TASKS:
            parser.error(f"unknown task {task!r}; choose from {TASKS}")

    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    shipped_from = "given"
    if args.shipped_variant == AUTO:
        print("shipped: asking the service which variants this host is served (python -m service.models.calibrate "
              "--pins; its calibration takes ~30 s the first time on a host) ...", flush=True)
        args.shipped_variant, shipped_from = served_variants()
    try:
        parse_pins(args.shipped_variant or "")
    except ValueError as error:
        parser.error(f"--shipped-variant: {error}")
    args.runtime = Runtime(threads=args.threads, spin=args.spin, single_thread_rows=args.single_thread_rows,
                           shipped_variant=args.shipped_variant, fuse_projections=args.fuse_projections,
                           device=args.device, kv_residence=args.kv_residence)
    if "torch" in sys.modules:
        print("warning: torch was imported before main(); OMP_WAIT_POLICY may not apply", file=sys.stderr)
    if not args.spin:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # read once, when torch loads OpenMP (libgomp)
    import torch

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    args.workdir.mkdir(parents=True, exist_ok=True)
    env = environment(args.runtime)
    print(describe_cpu(), flush=True)
    print(f"device={args.device} threads={args.threads} spin={args.spin} fuse_projections={args.fuse_projections} "
          f"repeats={args.repeats} "
          f"warmup={args.warmup} shipped variant={args.shipped_variant or 'as stored'} ({shipped_from}) "
          f"load average={env['load_average']}")
    print(f"versions: {env['versions']}", flush=True)

    results = []
    if "gpt" in tasks:
        results += bench_gpt(args, systems)
    if "translation" in tasks:
        results += bench_translation(args, systems)
    scaling = bench_scaling(args) if "scaling" in tasks else None
    prefix = bench_prefix(args) if "prefix" in tasks else None
    if results:
        print_table(results)
    if scaling is not None:
        print_scaling(scaling)

    report = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "quick": args.quick, "environment": env,
              "settings": {"device": args.device, "repeats": args.repeats, "warmup": args.warmup,
                           "sentences": args.sentences,
                           "shipped_variant": args.shipped_variant,
                           "gpt_batches": args.gpt_batches,
                           "translation_batches": args.translation_batches, "scaling_batches": args.scaling_batches,
                           "gpt": asdict(GptSpec()), "translation": asdict(TranslationSpec())},
              "results": results, "scaling": scaling, "prefix": prefix}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
