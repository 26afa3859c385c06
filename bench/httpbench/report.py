"""What the benchmark prints and records: a line per case and round, the tables, the goals (ratios of throughputs
measured in the same run), the ratios to the C++ peers (`service/llama-server 1 streams = 0.84`) and the
environment. Every ratio comes with its spread over the interleaved rounds (`case_spread`: round r's figure of one
case over round r's of the other, bench/spread.py's min-max, median and flag)."""

from __future__ import annotations

import os
import platform
import sys
import time
from collections import Counter
from typing import NamedTuple

from cpuinfo import cpu
from spread import ratio_spread, spread_text

from . import ct2_offline, llama_server
from .load import Result, round_figures

GOALS = (  # (key, description, numerator case, denominator case, threshold)
    ("vit_batching", "ViT images/s, dynamic batching on / off", "vit batching=on", "vit batching=off", 3.0),
    ("gpt_vs_baseline", "GPT tokens/s, ours 32 streams / baseline 32 clients", "gpt c=32", "baseline c=32", 5.0),
    ("gpt_scaling", "GPT tokens/s, ours 32 streams / ours 1 stream", "gpt c=32", "gpt c=1", 4.0),
    ("gpt_roofline", "GPT tokens/s, ours 32 streams / fp32 matmul roofline at batch 32", "gpt c=32",
     "roofline b=32", 0.4),
)
# gRPC against REST, the same work on the same server: (case over gRPC, its REST case); no goal, the figures
COMPARISONS = (("gpt grpc c=1", "gpt c=1"), ("gpt grpc c=32", "gpt c=32"), ("vit grpc", "vit batching=on"))
COMPARED = ("throughput", "latency_p50", "ttft_p50")  # the figures of each pair compared (`case_metric`)
NOT_MEASURED = "not measured in this run: --cases without {option}, or interrupted"


class PeerRatio(NamedTuple):
    """One ratio to a C++ peer: its printed `label`, the service's case and the peer's, each with the --cases entry
    that runs it."""

    label: str
    service_case: str
    service_option: str
    peer_case: str
    peer_option: str


ROOFLINE_STEPS = 64  # decoding steps per timed pass of the roofline
ROOFLINE_REPEATS = 5


def gpt_roofline(architecture: dict, batch: int, threads: int) -> dict:
    """The fp32 matmul roofline of one decoding step of the served GPT's shape at `batch` rows (bench_engine.py's,
    `enginebench.scaling.run_roofline_gpt`: the step's matmuls in torch, same threads), as a pseudo-case for
    `evaluate_goals`."""
    import statistics

    import torch
    from enginebench.scaling import run_roofline_gpt
    from enginebench.workloads import GptSpec

    torch.set_num_threads(threads)
    spec = GptSpec(vocab_size=architecture["vocab_size"], d_model=architecture["d_model"],
                   n_layers=architecture["n_layers"], n_heads=architecture["n_heads"], d_ff=architecture["d_ff"],
                   context_length=architecture["context_length"], new_tokens=ROOFLINE_STEPS)
    generate = run_roofline_gpt(spec, batch)
    generate(None)  # warm-up
    seconds = []
    for _ in range(ROOFLINE_REPEATS):
        started = time.perf_counter()
        generate(None)
        seconds.append(time.perf_counter() - started)
    return {"case": f"roofline b={batch}", "unit": "tokens/s", "errors": 0, "work_per_server_cpu_s": None,
            "throughput": batch * ROOFLINE_STEPS / statistics.median(seconds), "seconds": seconds}


def case_metric(summary: dict | None, name: str) -> float | None:
    """A case summary's figure that ratios are taken of, or one round's (`load.round_figures`): "throughput"
    (work/s; None for a case that did no work), "ttft_p50" and "latency_p50" (ms), "time_per_request" (ms of wall
    time per successful request); None for a case that did not run."""
    if summary is None:
        return None
    if name == "throughput":
        return summary["throughput"] or None
    if name == "ttft_p50":
        return (summary["ttft_ms"] or {}).get("p50")
    if name == "latency_p50":
        return summary["latency_ms"]["p50"]
    if name == "time_per_request":
        return summary["wall_s"] / summary["ok"] * 1000.0 if summary["ok"] else None
    raise ValueError(f"unknown metric {name!r}")


def case_spread(numerator: dict | None, denominator: dict | None, metric: str) -> dict | None:
    """The spread of the ratio of two cases' `metric` over the rounds both ran (round r's figure of one over round
    r's of the other: `spread.ratio_spread`); None when either did not run or no round has both figures."""
    if not numerator or not denominator:
        return None
    return ratio_spread([case_metric(r, metric) for r in numerator.get("rounds", [])],
                        [case_metric(r, metric) for r in denominator.get("rounds", [])])


def print_spread(label: str, spread: dict | None, indent: str = "  ") -> None:
    """`<label>: rounds min-max, median m of n` (FLAGGED where the rounds disagree), under its ratio's line."""
    if spread is not None:
        print(f"{indent}{label}: {spread_text(spread)}")


def _fmt(value, pattern: str) -> str:
    return "n/a" if value is None else format(value, pattern)


def describe_round(unit: str, results: list[Result], load: tuple[float, float] | None = None) -> str:
    """One case's round: throughput, successes, p50 latency, the machine's load before / after it, errors."""
    figures = round_figures(results, stream=False)
    errors = Counter(r.error for r in results if r.error)
    return (f"{figures['throughput']:8.1f} {unit:<12} {figures['ok']:>5}/{len(results):<5} ok  "
            f"p50 {_fmt(figures['latency_ms']['p50'], '.0f')} ms"
            + (f"  load {load[0]:.2f}/{load[1]:.2f}" if load else "")
            + (f"  errors {dict(errors)}" if errors else ""))


def print_tables(cases: list[dict]) -> None:
    endpoints: dict[str, list[dict]] = {}
    for case in cases:
        endpoints.setdefault(case["endpoint"], []).append(case)
    header = (f"{'case':<18} {'conc':>4} {'requests':>8} {'errors':>6} {'throughput':>19} {'req/s':>8} "
              f"{'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'TTFT p50/p95':>13} {'batch':>6} "
              f"{'cpu srv/loop/cli':>17} {'work/srv-cpu-s':>14}")
    for endpoint, rows in endpoints.items():
        print(f"\n{endpoint}")
        print(header)
        print("-" * len(header))
        for r in rows:
            lat, ttft = r["latency_ms"], r["ttft_ms"]
            ttft_text = f"{_fmt(ttft['p50'], '.0f')}/{_fmt(ttft['p95'], '.0f')} ms" if ttft else "-"
            wall = r["wall_s"] or float("nan")
            cores = [r["server_cpu_s"], r["server_main_thread_cpu_s"], r["client_cpu_s"]]
            cpu = "/".join(_fmt(c and c / wall, ".2f") for c in cores)
            print(f"{r['case']:<18} {r['concurrency']:>4} {r['requests']:>8} {r['errors']:>6} "
                  f"{r['throughput']:>8.1f} {r['unit']:<10} {r['requests_per_s']:>8.1f} {_fmt(lat['p50'], '.1f'):>8} "
                  f"{_fmt(lat['p95'], '.1f'):>8} {_fmt(lat['p99'], '.1f'):>8} {ttft_text:>13} "
                  f"{_fmt(r['mean_batch'], '.1f'):>6} {cpu:>17} {_fmt(r['work_per_server_cpu_s'], '.1f'):>14}")
            if r["errors"]:
                print(f"{'':<18} errors: {r['error_kinds']}")
    print("\nbatch: mean rows per decoding step (text) or images per ONNX Runtime call (ViT), from the service's "
          "/metrics;\nsentences per call for CTranslate2 offline.\ncpu srv/loop/cli: cores used by the server "
          "process, by its main (event-loop) thread, and by the client.\nwork/srv-cpu-s: work per CPU-second of the "
          "server process (throughput with the CPU share factored out;\na diagnostic for a shared machine, not what "
          "the goals are judged on).")


def evaluate_goals(cases: list[dict]) -> list[dict]:
    by_case = {c["case"]: c for c in cases}
    goals = []
    for key, text, num, den, threshold in GOALS:
        a, b = by_case.get(num), by_case.get(den)
        ratio = a["throughput"] / b["throughput"] if a and b and b["throughput"] > 0 else None
        errors = (a["errors"] if a else 0) + (b["errors"] if b else 0)
        # strict: errors in either case void a PASS (the denominator's would inflate the ratio)
        status = "SKIPPED" if ratio is None else "MISS" if ratio < threshold or errors else "PASS"
        per_cpu = (a["work_per_server_cpu_s"] / b["work_per_server_cpu_s"]
                   if a and b and a["work_per_server_cpu_s"] and b["work_per_server_cpu_s"] else None)
        goals.append({"goal": key, "description": text, "ratio": ratio, "threshold": threshold, "status": status,
                      "numerator": num, "denominator": den, "errors_in_cases": errors,
                      "ratio_per_server_cpu_s": per_cpu, "spread": case_spread(a, b, "throughput")})
    return goals


def print_goals(goals: list[dict]) -> None:
    print("\nGoals (ratios of throughputs measured in this run):")
    for g in goals:
        print(f"  {g['status']:<7} {g['description']}: {_fmt(g['ratio'], '.2f')}x (goal >= {g['threshold']:g}x)"
              f"   [per server CPU-second: {_fmt(g['ratio_per_server_cpu_s'], '.2f')}x]"
              + (f"  [errors in these cases: {g['errors_in_cases']}]" if g["errors_in_cases"] else ""))
        print_spread(g["description"], g["spread"], indent="          ")


def evaluate_comparisons(cases: list[dict]) -> list[dict]:
    """gRPC / REST of each pair in COMPARISONS that ran: throughput, p50 latency and p50 time to first token."""
    by_case = {c["case"]: c for c in cases}
    out = []
    for grpc_case, rest_case in COMPARISONS:
        a, b = by_case.get(grpc_case), by_case.get(rest_case)
        if not a or not b:
            continue
        row = {"grpc": grpc_case, "rest": rest_case}
        for metric in COMPARED:
            x, y = case_metric(a, metric), case_metric(b, metric)
            row[metric] = x / y if x is not None and y else None
        out.append({**row, "errors_in_cases": a["errors"] + b["errors"],
                    "spread": {metric: case_spread(a, b, metric) for metric in COMPARED}})
    return out


def print_comparisons(comparisons: list[dict]) -> None:
    if not comparisons:
        return
    print("\ngRPC against REST (same server, same work; > 1 throughput: gRPC faster, < 1 latency: gRPC faster):")
    for c in comparisons:
        print(f"  grpc/rest {c['rest']} throughput = {_fmt(c['throughput'], '.2f')}   p50 latency = "
              f"{_fmt(c['latency_p50'], '.2f')}   p50 TTFT = {_fmt(c['ttft_p50'], '.2f')}"
              + (f"  [errors in these cases: {c['errors_in_cases']}]" if c["errors_in_cases"] else ""))
        for metric, spread in c["spread"].items():
            print_spread(f"grpc/rest {c['rest']} {metric}", spread, indent="    ")


def peer_ratios(gpt_concurrency: list[int], translation_concurrency: list[int]) -> list[PeerRatio]:
    """The service's throughput over the peers', per concurrency: the GPT's streams against llama-server's at as
    many streams (its f32 weights, then its q8_0), translation's clients against CTranslate2 offline at its batch."""
    ratios = [PeerRatio(f"service/{option} {c} streams", f"gpt c={c}", "gpt", llama_server.case_name(c, option),
                        option) for option in llama_server.SERVERS for c in gpt_concurrency]
    ratios += [PeerRatio(f"service-http {c} clients/ctranslate2 offline b{ct2_offline.BATCH}", f"translation c={c}",
                         "translation", ct2_offline.CASE_NAME, "ctranslate2") for c in translation_concurrency]
    return ratios


def evaluate_peers(cases: list[dict], ratios: list[PeerRatio], skipped: dict[str, str]) -> list[dict]:
    """Each ratio's row: the value (None when either case did not run, with the `reason`: its skip reason, e.g.
    llama.cpp not built, or the --cases entry that would run it), both throughputs and the errors in the cases."""
    by_case = {c["case"]: c for c in cases}
    rows = []
    for ratio in ratios:
        service, peer = by_case.get(ratio.service_case), by_case.get(ratio.peer_case)
        value = service["throughput"] / peer["throughput"] if service and peer and peer["throughput"] > 0 else None
        reason = None
        if value is None:
            missing = ratio.peer_option if peer is None else ratio.service_option if service is None else None
            reason = (skipped.get(missing) or NOT_MEASURED.format(option=missing)) if missing else \
                f"no throughput in {ratio.peer_case}"
        rows.append({"ratio": ratio.label, "value": value, "reason": reason,
                     "unit": (service or peer or {}).get("unit"),
                     "numerator": ratio.service_case, "denominator": ratio.peer_case,
                     "service_throughput": service["throughput"] if service else None,
                     "peer_throughput": peer["throughput"] if peer else None,
                     "errors_in_cases": (service["errors"] if service else 0) + (peer["errors"] if peer else 0),
                     "spread": case_spread(service, peer, "throughput")})
    return rows


def peer_line(row: dict) -> str:
    """`service/llama-server 1 streams = 0.84`; `= n/a (why)` when it was not measured; errors in brackets."""
    value = f"{row['value']:.2f}" if row["value"] is not None else f"n/a ({row['reason']})"
    errors = f"  [errors in these cases: {row['errors_in_cases']}]" if row["errors_in_cases"] else ""
    return f"{row['ratio']} = {value}{errors}"


def print_peers(rows: list[dict]) -> None:
    if not rows:
        return
    print("\nThe C++ peers (service throughput / the peer's, measured in this run; > 1: the service faster):")
    for row in rows:
        print(peer_line(row))
        print_spread(row["ratio"], row["spread"])


def environment(args) -> dict:
    versions = {}
    for package in ("numpy", "onnxruntime", "torch", "transformers", "fastapi", "uvicorn", "httpx", "grpcio",
                    "ctranslate2"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:  # noqa: BLE001 - not installed
            versions[package] = None
    from enginebench.llama_cpp import version as llama_cpp_version

    versions["llama.cpp"] = llama_cpp_version()
    return {"python": platform.python_version(), "machine": platform.machine(), "cpu": cpu(),
            "cpu_count": os.cpu_count(),
            "threads": args.threads, "spin": args.spin, "load_average": os.getloadavg(),
            "niceness": os.nice(0), "executable": sys.executable, "versions": versions}

