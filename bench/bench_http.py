"""HTTP benchmark: throughput and client-side p50/p95/p99 latency of the running service, per endpoint, at fixed
concurrencies, plus the baseline a user would otherwise write (transformers `generate()` behind FastAPI).

What it measures (closed loop: N client tasks, each sends its next request when its previous one has finished):
- `POST /v1/generate`, streamed (SSE), greedy (`temperature: 0`), `max_new_tokens` 64, prompts of 32 characters of
  tinyshakespeare's validation text, at 1 and 32 concurrent streams -> tokens/s (tokens counted from the SSE
  events, checked against the final event's `usage`), time to first token p50/p95/p99, request latency;
- `POST /v1/translate`, beam 4, one Multi30k validation sentence per request, 16 concurrent -> sentences/s;
- `POST /v1/classify`, one Fashion-MNIST test image per request (PNG, multipart `files`), 64 concurrent ->
  images/s, on two servers: dynamic batching on and off (TSERVE_VIT_BATCHING=true / false);
- the baseline, `bench/baseline_server.py`: `POST /generate` calling `GPT2LMHeadModel.generate()` per request in
  FastAPI's threadpool, same prompts and token count, not streamed, at 1 and 32 concurrent clients -> tokens/s;
- the same service over gRPC (the Open Inference Protocol, `grpc.aio` channels, tritonclient's raw tensor
  contents): the GPT streamed (ModelStreamInfer, greedy, the same screened prompts and tokens) at 1 and 32 streams,
  and the ViT, one PNG per ModelInfer as the binary BYTES input IMAGE, at 64 concurrent; printed as
  `grpc/rest <case> = <ratio>` of throughput beside their REST cases (SSE; multipart), with latency and TTFT;
- the C++ peers on the same random weights (issue 23), in the same run: `llama-server` (llama.cpp, `make llama-cpp`
  builds it) serving the GPT, written as GGUF by bench/enginebench/llama_cpp.py and started as bench-engine starts it
  (slots = the most concurrent streams, continuous batching, the same threads, its default f16 KV cache), sent the
  gpt case's screened prompts as the service's token ids on its OpenAI `/v1/completions`, streamed, greedy, exactly
  as many tokens, by the same client at the same concurrencies; and CTranslate2 offline (no HTTP), float32, batches
  of 16 of the translation case's sentences (the service's token ids), the same beams and pinned tokens, through
  bench/enginebench/ct2.py's converter and worker (bench/httpbench/llama_server.py, ct2_offline.py); and
  `llama-server-q8_0`, the same on the GGUF's q8_0 (llama.cpp's int8 format, the peer of the service's int8 variants,
  issue 56). Printed as `service/llama-server 1 streams = <ratio>`, `service/llama-server 32 streams = <ratio>`,
  `service/llama-server-q8_0 1 streams = <ratio>` (tokens/s) and
  `service-http 16 clients/ctranslate2 offline b16 = <ratio>` (sentences/s); a peer that cannot run (llama.cpp
  not built: run `make llama-cpp`; ctranslate2 missing; --repository, whose weights the peers cannot rebuild)
  gives `= n/a (<why>)`, never a failed run;
- constrained (issue 54, bench/httpbench/constrained.py): the gpt case's prompts and streams, each request with a
  bounded 8-property JSON schema (the same one; and at 1 stream a new one per request, compiled before its first
  token), printed as `constrained/unconstrained N streams tokens/s = <ratio>` and the p50 TTFT ratios of a new
  schema, the cached one and unconstrained;
- issue 55's cases, each on two GPT-only servers started with one setting apart (--server-env below it), printed
  as ratios with their goals (PASS/MISS) under the CPU: `prefix` (bench/httpbench/prefix.py; TSERVE_PREFIX_CACHE
  true / false): time to first token of a 200-token shared prefix + 16 tokens, hit / miss at 1 stream (goal <= 0.3),
  and tokens/s at 32 streams of prompts that share no prefix, cache on / off (goal >= 0.97); `lm-eval`
  (bench/httpbench/lmeval.py; the same two servers): the requests lm-eval sends for a multiple-choice task (its
  order, its `/v1/completions` bodies: echo, logprobs) over a larger task of the fixture's shape, replayed one at a
  time -> wall time cache on / off (goal <= 0.67); `speculation` (bench/httpbench/speculation.py; TSERVE_SPECULATION
  ngram / off, on the release GPT's trained weights: model_repository unless --repository): greedy tokens/s on / off
  on copy-heavy prompts at 1 stream (goal >= 1.5), on open continuations at 1 stream (>= 0.95) and 32 (>= 0.98).
Goals, printed as PASS/MISS: ViT images/s with batching >= 3x without; GPT tokens/s at 32 streams >= 5x the
baseline's at 32 clients, and >= 4x this service's at 1 stream. A case with any error voids its goal's PASS.
Per case it also reports the mean batch (rows per decoding step, images per ONNX Runtime call; from /metrics),
the cores used by the server process, its main (event-loop) thread and the client, and the work per server
CPU-second: a diagnostic of efficiency with the machine's CPU share factored out (the goals use throughput).

Models: unless --repository names a model repository (e.g. of trained models), the script builds one, once, into
.cache/bench_http/repository-<hash> with the project's exporter (`export.onnx_export.EXPORTERS`): the release
presets' sizes (GPT d=256, 6 layers, 4 heads, context 256, byte vocabulary 257; translation d=256, 6+3 layers,
vocabulary 8,000; ViT with a convolutional stem, d=128, 6 layers, 28x28 grey) with RANDOM weights (seed 0), the
byte tokenizer for GPT and a BPE trained on 5,000 Multi30k training pairs for translation. Random weights cost
the same as trained ones; only the output lengths differ, and those are pinned (below). Such versions record no
quality-checked weights variant, so the service runs them in the variants it chose for the release models on this
host (TSERVE_VARIANT from `python -m service.models.calibrate --pins`, bench/shipped.py; printed; --server-env
TSERVE_VARIANT=... overrides). Data: --data-dir,
$TSERVE_DATA_DIR, else ../shared/data, else ./data.

Fairness:
- Every server is a subprocess on a free port, started from a clean environment (no inherited TSERVE_*, no .env:
  only what this script sets, plus --server-env), measured after /health/ready and a warm-up (--warmup requests
  per case; default one per client). All servers are started first and the cases run round-robin, --rounds times,
  each for duration/rounds (like bench_engine.py's interleaved repeats): a background load that drifts over time
  hits every case alike. One case runs at a time, and one server: every other one (the peers' processes
  included) is stopped (SIGSTOP) while a case runs, and continued when its own cases come.
- Same thread settings for all: --threads ONNX Runtime intra-op threads (TSERVE_INTRA_OP_THREADS, inter-op 1) and
  torch threads for the baseline (plus OMP_NUM_THREADS); idle threads sleep (TSERVE_ORT_SPIN=false;
  OMP_WAIT_POLICY=PASSIVE) unless --spin. Device CPU (TSERVE_DEVICE=cpu) unless --device cuda (the service only).
- Same work: greedy is deterministic, so the GPT prompts are screened once on the service and only those that run
  to `max_new_tokens` without EOS are used, by the service and the baseline alike (natural decoding, no
  min_new_tokens on the service side); the baseline gets `min_new_tokens == max_new_tokens`, so it generates exactly as
  many tokens. Translation with random weights is pinned to `min_new_tokens == max_new_tokens`
  (--translation-tokens, 30 like bench_engine.py); with --repository it decodes naturally unless that is given.
- One client for all: httpx on one event loop (uvloop when installed), one AsyncClient (one keep-alive
  connection) per concurrent task, request bodies encoded beforehand. (One AsyncClient shared by 64 tasks costs
  ~5 ms of client CPU per request in httpcore's pool bookkeeping, measured here, against ~0.8 ms this way.)
  Latency is client-side: from sending the request to the end of the response ([DONE] for streams).
  Throughput = work of the successful timed requests / the rounds' wall time (first start to last end).
- Every non-2xx response, transport error, SSE error event or stream without [DONE] is an error: reported per
  kind, never counted as work.
- The peers keep their own thread behaviour, as in bench-engine: llama.cpp's threads spin at ggml's barriers and
  CTranslate2's OpenMP threads spin a while after their work, so on cores that other jobs keep busy their
  figures collapse (ours sleep): measure the peers' rows on an otherwise idle machine.
- The machine is shared: compare ratios from one run, not absolute numbers across runs. Run it niced. Every
  printed ratio has its spread under it (`<ratio>: rounds min-max, median m of n`: round r's figure of one case
  over round r's of the other, FLAGGED where they disagree by more than 1.3x, bench/spread.py), and every round's
  line the machine's 1-minute load before / after it; the JSON report keeps both (`spread`, `rounds`,
  `load_before_after`).

Run (main venv), e.g. as `make bench-http`:
    nice -n 10 .venv/bin/python bench/bench_http.py --quick      # smoke run, ~1-2 minutes once models are built
    nice -n 10 .venv/bin/python bench/bench_http.py              # full run (24 s per case), reports/bench_http.json
    nice -n 10 .venv/bin/python bench/bench_http.py --quick --cases gpt,llama-server,translation,ctranslate2
                                                                 # the peers' rows alone, smoke run
    nice -n 10 .venv/bin/python bench/bench_http.py --quick --cases prefix,lm-eval,speculation
                                                                 # issue 55's cases alone, smoke run (~1-2 minutes)
Options: --duration S | --requests N (per case, over all rounds; CTranslate2's: batches), --rounds N, --warmup N,
--device cpu|cuda, --threads N, --spin, --repository DIR, --data-dir DIR, --max-new-tokens N,
--cases gpt,translation,vit,baseline,grpc,llama-server,llama-server-q8_0,ctranslate2,constrained,prefix,lm-eval,
speculation,
--gpt-concurrency 1,32,
--baseline-concurrency 1,32, --translation-concurrency 16, --vit-concurrency 64, --num-beams N,
--translation-tokens N, --server-env KEY=VALUE, --speculation-variant VARIANT, --out PATH, --workdir PATH.

Code: this file (options, the run); bench/httpbench/: repository.py (the random-weight models), servers.py (the
servers, by the shared launcher service.client.launcher, and one running at a time), load.py (the load generator),
cases.py (workloads and cases), llama_server.py and ct2_offline.py (the C++ peers), constrained.py (the
constrained case and its ratios), prefix.py, lmeval.py and speculation.py (issue 55's cases) with ab.py (their
servers, counters and ratios), report.py (lines, tables, goals, the peers' ratios).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import contextlib
import json
import signal
import sys
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
for folder in (PROJECT_ROOT, PROJECT_ROOT / "bench"):  # the project's packages, and httpbench
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from cpuinfo import describe as describe_cpu  # after the sys.path set-up
from httpbench.cases import (
    Case,
    baseline_workload,
    gpt_grpc_workload,
    gpt_prompts,
    gpt_workload,
    screen_prompts,
    translation_sentences,
    translation_workload,
    vit_grpc_workload,
    vit_workload,
)
from httpbench import ab, lmeval, prefix, speculation
from httpbench.constrained import constrained_cases, constrained_ratios, evaluate_constrained, print_constrained
from httpbench.ct2_offline import ctranslate2_case, ctranslate2_worker
from httpbench.llama_server import SERVERS as LLAMA_SERVERS, case_name as llama_server_case, llama_server, \
    llama_server_workload
from httpbench.report import (
    describe_round,
    environment,
    evaluate_comparisons,
    evaluate_goals,
    evaluate_peers,
    gpt_roofline,
    peer_ratios,
    print_comparisons,
    print_goals,
    print_peers,
    print_tables,
)
from httpbench.repository import build_repository
from httpbench.servers import (
    baseline_server,
    resume,
    run_alone,
    server_record,
    service_server,
    tokenize,
)

from service.client.launcher import ServiceProcess
from shipped import served_variants


CASES = ("gpt", "translation", "vit", "baseline", "grpc", *LLAMA_SERVERS, "ctranslate2", "constrained", "prefix",
         "lm-eval", "speculation")
PEERS = (*LLAMA_SERVERS, "ctranslate2")  # the C++ peers' cases: on the random-weight models only
# the cases that need the service: the peers' too (their prompts are screened on it, their inputs tokenized by it)
SERVICE_CASES = ("gpt", "translation", "vit", "grpc", *LLAMA_SERVERS, "ctranslate2", "constrained")
TRANSLATION_SENTENCES = 1014  # Multi30k's validation split, all of it
RELEASE_REPOSITORY = PROJECT_ROOT / "model_repository"  # the speculation case's trained GPT (unless --repository)
# the interleaved rounds every case runs (--rounds), each ratio's spread taken over them: issue 56 asks for >= 3; a
# smoke run's 2 still shows a spread
ROUNDS, QUICK_ROUNDS = 3, 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 s per case in 2 rounds, small warm-ups")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds of load per case, over all rounds (default 24; quick 4)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per case, over all rounds, instead of --duration")
    parser.add_argument("--rounds", type=int, default=None,
                        help="the cases run round-robin this many times, each for duration/rounds; every ratio's "
                             "spread is over these rounds (default 3; quick 2)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed requests per case (default: one per client; quick: at most 4)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="the service's TSERVE_DEVICE (default cpu); the baseline and the peers stay on CPU")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime / torch intra-op threads (default 2)")
    parser.add_argument("--spin", action="store_true", help="let idle threads busy-wait (only on idle machines)")
    parser.add_argument("--repository", type=Path, default=None,
                        help="serve this model repository instead of building random-weight models")
    parser.add_argument("--data-dir", type=Path, default=None, help="data folder (default $TSERVE_DATA_DIR, "
                        "else ../shared/data, else ./data)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="GPT tokens per request (default 64)")
    parser.add_argument("--prompt-chars", type=int, default=32, help="GPT prompt length in characters (default 32)")
    parser.add_argument("--prompts", type=int, default=64, help="GPT candidate prompts (default 64)")
    parser.add_argument("--gpt-concurrency", default="1,32")
    parser.add_argument("--baseline-concurrency", default="1,32")
    parser.add_argument("--translation-concurrency", default="16")
    parser.add_argument("--vit-concurrency", default="64")
    parser.add_argument("--num-beams", type=int, default=4, help="translation beam width (default 4)")
    parser.add_argument("--translation-tokens", type=int, default=None,
                        help="pin translations to exactly this many tokens (default 30 with random weights; "
                             "natural lengths with --repository); 0 = natural")
    parser.add_argument("--timeout", type=float, default=300.0, help="client timeout per request, seconds")
    parser.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the service (e.g. TSERVE_VIT_MAX_QUEUE_DELAY_MS=2); repeatable")
    parser.add_argument("--speculation-variant", default=None,
                        help="the GPT's weights variant on both speculation servers (e.g. int8+gqa+kv8, fp32); "
                             "default: the host's, less +kv8 (speculation verifies float KV caches only)")
    parser.add_argument("--out", type=Path, default=Path("reports/bench_http.json"))
    parser.add_argument("--workdir", type=Path, default=Path(".cache/bench_http"),
                        help="built models and server logs (default .cache/bench_http)")
    args = parser.parse_args(argv)
    args.duration = args.duration if args.duration is not None else (4.0 if args.quick else 24.0)
    args.rounds = max(1, args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS))
    args.cases = [c for c in args.cases.split(",") if c]
    for case in args.cases:
        if case not in CASES:
            parser.error(f"unknown case {case!r}")
    for name in ("gpt_concurrency", "baseline_concurrency", "translation_concurrency", "vit_concurrency"):
        setattr(args, name, [int(c) for c in getattr(args, name).split(",") if c])
    try:
        args.server_env = dict(item.split("=", 1) for item in args.server_env)
    except ValueError:
        parser.error("--server-env takes KEY=VALUE")
    args.workdir = args.workdir.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # like Ctrl-C: stop the servers, report, exit 130
    from models.data import resolve_data_dir
    from service.repository import TOKENIZER_FILE, ModelRepository

    data_dir = resolve_data_dir(args.data_dir)
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE" if args.spin else "PASSIVE"  # for the export, if it runs
    env = environment(args)
    amount = f"{args.requests} requests" if args.requests else f"{args.duration:g} s"
    print(describe_cpu(), flush=True)
    print(f"threads={args.threads} spin={args.spin} per case: {amount} in {args.rounds} round(s); "
          f"load average={env['load_average']} nice={env['niceness']}", flush=True)
    random_weights = args.repository is None
    repository = build_repository(args.workdir, data_dir, args.threads) if random_weights else args.repository
    repo = ModelRepository(repository)
    kinds = {}
    for name in repo.model_names():
        kinds.setdefault(repo.get(name).kind, repo.get(name))
    print(f"repository: {repository} ({', '.join(f'{k}={v.name}:{v.version}' for k, v in kinds.items())})",
          flush=True)
    if random_weights and "TSERVE_VARIANT" not in args.server_env:
        # its versions record no quality-checked variant, so the service's own `auto` would run the stored one: pin
        # what the service chose for the release models on this host (bench/shipped.py)
        print("asking the service which variants this host is served (python -m service.models.calibrate --pins; "
              "its calibration takes ~30 s the first time on a host) ...", flush=True)
        pins, source = served_variants()
        if pins:
            args.server_env["TSERVE_VARIANT"] = pins
        print(f"service variants: {pins or 'as stored'} ({source})", flush=True)
    translation_tokens = args.translation_tokens if args.translation_tokens is not None else \
        (30 if random_weights else 0)

    skipped: dict[str, str] = {}
    for case, kind in (("gpt", "gpt"), ("translation", "translation"), ("vit", "vit"), ("baseline", "gpt"),
                       ("grpc", "gpt"), *((option, "gpt") for option in LLAMA_SERVERS), ("ctranslate2", "translation"),
                       ("constrained", "gpt"), ("prefix", "gpt"), ("lm-eval", "gpt")):
        if case in args.cases and kind not in kinds:
            skipped[case] = f"no {kind} model in {repository}"
    for case in PEERS:
        if case in args.cases and case not in skipped and not random_weights:
            skipped[case] = "the peers run the benchmark's own random-weight models, not --repository's"
    if "ctranslate2" in args.cases and "ctranslate2" not in skipped and not translation_tokens:
        skipped["ctranslate2"] = "CTranslate2 is timed on pinned lengths: --translation-tokens must be > 0"
    spec_repository = args.repository or RELEASE_REPOSITORY
    spec_gpt = None
    if "speculation" in args.cases:
        spec_repo = ModelRepository(spec_repository)
        spec_gpt = next((spec_repo.get(name) for name in spec_repo.model_names() if spec_repo.get(name).kind == "gpt"),
                        None)
        if spec_gpt is None:
            skipped["speculation"] = f"no gpt model in {spec_repository}"
    wanted = [c for c in args.cases if c not in skipped]
    max_new_tokens, prompts, gpt_architecture = args.max_new_tokens, [], {}
    if "gpt" in kinds:
        gpt_config = kinds["gpt"].config
        gpt_architecture = {**gpt_config["architecture"], "context_length": gpt_config["context_length"]}
        if args.prompt_chars + max_new_tokens > gpt_config["context_length"]:
            max_new_tokens = gpt_config["context_length"] - args.prompt_chars
            print(f"note: the GPT context is {gpt_config['context_length']}: max_new_tokens lowered to "
                  f"{max_new_tokens}", flush=True)
        prompts = gpt_prompts(data_dir, args.prompts, args.prompt_chars)

    cases: list[Case] = []
    servers: dict[str, ServiceProcess] = {}  # and the peers' (llama_cpp.Server, ct2.Worker): a name, pid, signals
    screening: dict | None = None
    constrained: dict | None = None
    issue55: dict[str, dict] = {}  # per case (prefix, lm-eval, speculation): what was set up, then its ratios
    started = time.perf_counter()
    interrupted = False
    with contextlib.ExitStack() as stack:

        def keep(name: str, server):
            """Start `server` (a context manager) for the whole run, continued before it is stopped at the end."""
            servers[name] = stack.enter_context(server)
            stack.callback(resume, servers[name])  # LIFO: runs before the server's own exit
            return servers[name]

        def skip(case: str, reason: str) -> None:
            skipped[case] = reason
            wanted.remove(case)
            print(f"{case}: skipped ({reason})", flush=True)

        try:
            # Every server is started first; then the cases run round-robin, so a background load that drifts over
            # time hits every case alike, each with the other servers stopped (`run_alone`).
            if any(c in wanted for c in SERVICE_CASES):
                keep("service", service_server(args, "service", repository, vit_batching=True))
                print(f"server 'service' (TSERVE_VIT_BATCHING=true) ready in {servers['service'].ready_seconds:.1f} s",
                      flush=True)
            if "vit" in wanted:
                import httpx

                openapi = httpx.get(f"{servers['service'].url}/openapi.json", timeout=30).json()
                if "/v1/classify" not in openapi.get("paths", {}):
                    skip("vit", "the service has no /v1/classify route yet (service/api/native/images.py)")
                else:
                    keep("service-no-batching", service_server(
                        args, "service-no-batching", repository, vit_batching=False, models=[kinds["vit"].name]))
                    print(f"server 'service-no-batching' (TSERVE_VIT_BATCHING=false, vit only) ready in "
                          f"{servers['service-no-batching'].ready_seconds:.1f} s", flush=True)
            if "baseline" in wanted:
                keep("baseline", baseline_server(args, gpt_architecture))
                print(f"server 'baseline' (transformers generate() per request) ready in "
                      f"{servers['baseline'].ready_seconds:.1f} s", flush=True)

            if any(c in wanted for c in ("prefix", "lm-eval")):  # the GPT alone, prefix cache on and off
                for name, env in prefix.SERVERS.items():
                    keep(name, ab.gpt_server(args, name, repository, kinds["gpt"].name, env))
                    print(f"server '{name}' ({', '.join(f'{k}={v}' for k, v in env.items())}, gpt only) ready in "
                          f"{servers[name].ready_seconds:.1f} s", flush=True)
            if "speculation" in wanted:  # the GPT alone, trained weights, speculation on and off
                variant, why = speculation.speculation_variant(args.server_env.get("TSERVE_VARIANT"), spec_gpt.name,
                                                               args.speculation_variant)
                print(f"speculation servers: {spec_repository} ({spec_gpt.name}:{spec_gpt.version}), variant {why}",
                      flush=True)
                for name, env in speculation.SERVERS.items():
                    env = {**env, **({"TSERVE_VARIANT": variant} if variant else {})}
                    keep(name, ab.gpt_server(args, name, spec_repository, spec_gpt.name, env))
                    print(f"server '{name}' ({', '.join(f'{k}={v}' for k, v in env.items())}, gpt only) ready in "
                          f"{servers[name].ready_seconds:.1f} s", flush=True)

            if any(c in wanted for c in ("gpt", "grpc", *LLAMA_SERVERS, "constrained")):
                prompts, screening = screen_prompts(servers["service"], prompts, max_new_tokens, args)
            for option in (o for o in LLAMA_SERVERS if o in wanted):  # f32, q8_0
                slots = max(args.gpt_concurrency, default=1)
                try:
                    keep(option, llama_server(args, repository, gpt_config["context_length"], slots, option))
                    print(f"server '{option}' ({LLAMA_SERVERS[option].file_type}, {slots} slots) ready in "
                          f"{servers[option].ready_seconds:.1f} s", flush=True)
                except (NotImplementedError, RuntimeError) as error:  # not built: `make llama-cpp`; did not start
                    skip(option, str(error))
            if "gpt" in wanted:
                for c in args.gpt_concurrency:
                    cases.append(Case(f"gpt c={c}", "POST /v1/generate (stream, greedy)", servers["service"],
                                      gpt_workload(prompts, max_new_tokens), c, kinds["gpt"].name))
            if "constrained" in wanted:
                try:
                    more, constrained = constrained_cases(servers["service"], kinds["gpt"].name, prompts,
                                                          max_new_tokens, args.gpt_concurrency)
                    cases += more
                except RuntimeError as error:  # its sample request failed
                    skip("constrained", str(error))
            if any(c in wanted for c in ("prefix", "lm-eval")):
                # one set of line starts for both cases' prompts, dealt out so that none begins like another
                text = prefix.shakespeare_text(data_dir)
                ttft_starts, no_prefix_starts, lm_eval_starts = ab.split_starts(ab.block_starts(
                    text, prefix.BLOCK_TOKENS, gpt_config["context_length"]), 3)
            if "prefix" in wanted:
                more, issue55["prefix"] = prefix.prefix_cases(servers, kinds["gpt"].name, text, ttft_starts,
                                                              no_prefix_starts)
                cases += more
            if "lm-eval" in wanted:
                try:
                    more, issue55["lm-eval"] = lmeval.lm_eval_cases(
                        servers, kinds["gpt"].name, text, lm_eval_starts,
                        kinds["gpt"].path / TOKENIZER_FILE, gpt_config["context_length"])
                    cases += more
                except RuntimeError as error:  # the tokenizer differs from the server's; too few documents
                    skip("lm-eval", str(error))
            if "speculation" in wanted:
                candidates = gpt_prompts(data_dir, speculation.CANDIDATES, args.prompt_chars)
                try:
                    if args.prompt_chars + speculation.COPY_PREFIX + speculation.NEW_TOKENS > \
                            spec_gpt.config["context_length"]:
                        raise RuntimeError(f"--prompt-chars {args.prompt_chars} + {speculation.COPY_PREFIX} + "
                                           f"{speculation.NEW_TOKENS} tokens exceed the GPT's context")
                    copy, info = speculation.screen(servers[speculation.OFF], candidates)
                except RuntimeError as error:  # no copy-heavy prompt: the case is skipped, the run goes on
                    skip("speculation", str(error))
                else:
                    issue55["speculation"] = {**info, "variant": why,
                                              "servers": {name: servers[name].environment.get("TSERVE_VARIANT")
                                                          for name in speculation.SERVERS}}
                    cases += speculation.speculation_cases(servers, spec_gpt.name, copy, candidates)
            if any(o in wanted for o in LLAMA_SERVERS):
                workload = llama_server_workload(tokenize(servers["service"], kinds["gpt"].name, prompts),
                                                 max_new_tokens)
                for option in (o for o in LLAMA_SERVERS if o in wanted):
                    for c in args.gpt_concurrency:
                        cases.append(Case(llama_server_case(c, option), f"{option} POST /v1/completions (stream, "
                                          "greedy)", servers[option], workload, c))
            if "grpc" in wanted:
                workload = gpt_grpc_workload(kinds["gpt"].name, prompts, max_new_tokens)
                for c in args.gpt_concurrency:
                    cases.append(Case(f"gpt grpc c={c}", "gRPC ModelStreamInfer (greedy)", servers["service"],
                                      workload, c, kinds["gpt"].name))
                if "vit" in kinds:
                    vit_grpc = vit_grpc_workload(kinds["vit"].name, data_dir, 1024)
                    for i, c in enumerate(args.vit_concurrency):
                        cases.append(Case("vit grpc" + ("" if i == 0 else f" c={c}"),
                                          "gRPC ModelInfer (1 PNG, raw BYTES)", servers["service"], vit_grpc, c,
                                          kinds["vit"].name))
            elif "baseline" in wanted:
                print("note: the gpt case is not selected, so the baseline's prompts are not screened", flush=True)
            if "baseline" in wanted:
                for c in args.baseline_concurrency:
                    cases.append(Case(f"baseline c={c}", "baseline POST /generate (transformers)",
                                      servers["baseline"], baseline_workload(prompts, max_new_tokens), c))
            if "translation" in wanted:
                workload = translation_workload(data_dir, TRANSLATION_SENTENCES, args.num_beams,
                                                translation_tokens or None)
                for c in args.translation_concurrency:
                    cases.append(Case(f"translation c={c}", f"POST /v1/translate (beam {args.num_beams})",
                                      servers["service"], workload, c, kinds["translation"].name))
            if "ctranslate2" in wanted:
                try:
                    worker = keep("ctranslate2", ctranslate2_worker(args, repository))
                    print("worker 'ctranslate2' (offline, float32) ready", flush=True)
                except (ImportError, RuntimeError) as error:  # not installed; did not start
                    skip("ctranslate2", str(error))
                else:
                    sources = tokenize(servers["service"], kinds["translation"].name,
                                       translation_sentences(data_dir, TRANSLATION_SENTENCES))
                    cases.append(ctranslate2_case(worker, sources, args.num_beams, translation_tokens))
            if "vit" in wanted:
                vit = vit_workload(data_dir, 1024)
                for label, server in (("on", servers["service"]), ("off", servers["service-no-batching"])):
                    for i, c in enumerate(args.vit_concurrency):
                        name = f"vit batching={label}" + ("" if i == 0 else f" c={c}")
                        cases.append(Case(name, "POST /v1/classify (1 PNG per request)", server, vit, c,
                                          kinds["vit"].name))

            print("\nwarm-up", flush=True)
            for case in cases:
                warmup = args.warmup if args.warmup is not None else \
                    (min(case.concurrency, 4) if args.quick else case.concurrency)
                run_alone(case.server, servers.values())
                case.run_warmup(warmup, args.timeout)
            for round_number in range(1, args.rounds + 1):
                print(f"\nround {round_number}/{args.rounds}", flush=True)
                for case in cases:
                    requests = None if args.requests is None else max(1, args.requests // args.rounds)
                    run_alone(case.server, servers.values())
                    results = case.run_round(args.duration / args.rounds, requests, args.timeout)
                    print(f"  {case.name:<18} c={case.concurrency:<3} "
                          f"{describe_round(case.workload.unit, results, case.loads[-1] if case.loads else None)}",
                          flush=True)
        except KeyboardInterrupt:
            interrupted = True
            print("\ninterrupted: stopping the servers; reporting what was measured", flush=True)
    summaries = [case.summary() for case in cases if case.results]
    if summaries:
        print_tables(summaries)
    for summary in summaries:
        for note in summary["notes"]:
            print(f"note ({summary['case']}): {note}")
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    roofline = None
    if any(s["case"] == "gpt c=32" for s in summaries):  # the servers are down: nothing else shares the cores
        roofline = gpt_roofline(gpt_architecture, 32, args.threads)
        print(f"\nfp32 matmul roofline of the GPT's step at batch 32: {roofline['throughput']:.0f} tokens/s")
    goals = evaluate_goals(summaries + ([roofline] if roofline else []))
    print_goals(goals)
    comparisons = evaluate_comparisons(summaries)
    print_comparisons(comparisons)
    ratios = [r for r in peer_ratios(args.gpt_concurrency, args.translation_concurrency) if r.peer_option in args.cases]
    peers = evaluate_peers(summaries, ratios, skipped)
    print_peers(peers)
    if constrained is not None:
        constrained["ratios"] = evaluate_constrained(summaries, constrained_ratios(args.gpt_concurrency), skipped)
        print_constrained(constrained["ratios"])
    cpu_line = describe_cpu().removeprefix("CPU: ")
    for option, title, ratios, annotate in (
            ("prefix", "Prefix caching (issue 55): hit / miss, cache on / off", prefix.prefix_ratios(),
             prefix.annotate),
            ("lm-eval", "lm-eval multiple choice over HTTP (issue 55), replayed, cache on / off",
             lmeval.lm_eval_ratios(), prefix.annotate),
            ("speculation", "n-gram speculation (issue 55), on / off", speculation.speculation_ratios(),
             speculation.annotate)):
        if option in args.cases:
            rows = annotate(ab.evaluate(summaries, ratios, skipped), summaries)
            issue55.setdefault(option, {})["ratios"] = rows
            ab.print_ratios(title, cpu_line, rows)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")

    report = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join([Path(sys.executable).name] + sys.argv),
        "quick": args.quick, "interrupted": interrupted, "environment": env,
        "settings": {"duration_s": args.duration, "requests": args.requests, "rounds": args.rounds,
                     "warmup": args.warmup, "device": args.device, "threads": args.threads, "spin": args.spin,
                     "max_new_tokens": max_new_tokens, "prompt_chars": args.prompt_chars,
                     "num_beams": args.num_beams, "translation_tokens": translation_tokens or None,
                     "random_weights": random_weights, "repository": str(repository),
                     "server_env": args.server_env, "concurrency": {
                         "gpt": args.gpt_concurrency, "baseline": args.baseline_concurrency,
                         "translation": args.translation_concurrency, "vit": args.vit_concurrency}},
        "prompt_screening": screening,
        "servers": [server_record(s) for s in servers.values()],
        "cases": summaries, "roofline": roofline, "goals": goals, "comparisons": comparisons, "peers": peers,
        "constrained": constrained, "issue55": issue55, "skipped": skipped,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
