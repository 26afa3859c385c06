"""What the benchmark prints and records: a case's systems and ratios, the comparison table, and the environment
(versions, threads, load) written into reports/bench_engine.json."""

from __future__ import annotations

import os
import platform
import statistics
import sys

from cpuinfo import cpu
from spread import load_text, spread_text

from .llama_cpp import SYSTEM_FILE_TYPES, batched_bench_names
from .llama_cpp import version as llama_cpp_version
from .systems import SYSTEMS
from .workloads import Runtime

def _fmt(value: float | None, pattern: str) -> str:
    return "n/a" if value is None else format(value, pattern)


def print_result(result: dict) -> None:
    repeats = max((len(entry["seconds"]) for entry in result["systems"].values()), default=0)
    print(f"\n  {result['case']} ({result['unit']}, median of {repeats} passes)")
    for name in SYSTEMS:
        entry = result["systems"].get(name)
        if entry is None:
            print(f"    {name:<16} {'skipped':>10}")
        else:
            seconds = entry["seconds"]
            print(f"    {name:<16} {entry['throughput']:>10.1f}   (median {entry['median_s']:.3f} s/pass, "
                  f"range {min(seconds):.3f}-{max(seconds):.3f})")
    for name, choice in result.get("intra_threads", {}).items():
        probed = ", ".join(f"{n} thread{'s' * (n > 1)} {seconds * 1e3:.1f} ms"
                           for n, seconds in choice["median_s"].items())
        print(f"    {name} intra_threads {choice['threads']}, the faster in the warm-up ({probed} a call)")
    ratios = result["ratios"]
    print("    " + "   ".join(f"{key} = {_fmt(value, '.2f')}" for key, value in ratios.items() if value is not None))
    for key, spread in result.get("ratio_spread", {}).items():  # each round's ratio: how far one run can be off
        if spread is not None:
            print(f"    {key}: {spread_text(spread)}")
    if "load_before_after" in result:
        print(f"    {load_text(*result['load_before_after'])}")
    batch = result.get("batch", "?")
    # the C++ peers' lines, as the issues of record ask: `ours/<peer> <case> = x`, `ours/<llama.cpp> b<batch> = x`
    for peer, where in (("ctranslate2", result["case"]), ("ctranslate2-int8", result["case"]),
                        ("llama.cpp", f"b{batch}"), ("llama.cpp-q8_0", f"b{batch}")):
        for mine in ("ours", "shipped"):
            key = f"{mine}/{peer}"
            if ratios.get(key) is not None:
                goal = result.get("goals", {}).get(key)
                print(f"    {key} {where} = {ratios[key]:.2f}"
                      + (f"   (issue 56 goal {goal['goal']}: {goal['status']})" if goal else ""))
    for file_type in SYSTEM_FILE_TYPES.values():  # llama.cpp's own benchmark on each GGUF (a failed row says why)
        key, peer = batched_bench_names(file_type)
        if "runs" not in result.get(key, {}):
            continue
        row = result[key]
        print(f"    {peer} b{batch} (llama.cpp's own timer on the same {file_type} GGUF, median of {len(row['runs'])} "
              f"runs, not interleaved; random tokens in, nothing sampled, no HTTP): {row['tokens_per_s']:.1f} "
              f"tokens/s with its prompt pass, S_TG {row['speed_tg']:.1f} tokens/s decoding alone")
        for mine in ("ours", "shipped"):
            if ratios.get(f"{mine}/{peer}") is not None:
                print(f"    {mine}/{peer} b{batch} = {ratios[f'{mine}/{peer}']:.2f}")
    if "ours_llama_cpp_agreement" in result:
        agreed = result["ours_llama_cpp_agreement"]
        first, length = agreed["first_divergence"], agreed["tokens"] // agreed["sequences"]
        print(f"    agreement ours vs llama.cpp (same weights; its GELU is the tanh approximation over fp16 inputs): "
              f"{agreed['identical_sequences']}/{agreed['sequences']} identical sequences, "
              f"{agreed['identical_tokens']}/{agreed['tokens']} identical tokens; first divergence: median token "
              f"{statistics.median(first):.0f}, earliest {min(first)} (of {length}; {length} = never)")
    if "ours_ctranslate2_agreement" in result:
        print(f"    identical best beams ours vs ctranslate2 (same weights): "
              f"{result['ours_ctranslate2_agreement']:.0%}")
    if "shipped_ctranslate2_agreement" in result:
        print(f"    identical best beams shipped (as served) vs ctranslate2 float32: "
              f"{result['shipped_ctranslate2_agreement']:.0%}")
    if "transformers_optimum_agreement" in result:
        print(f"    identical outputs transformers vs optimum: {result['transformers_optimum_agreement']:.0%}")
    if "ours_genai_agreement" in result:
        print(f"    identical outputs ours vs genai (same graph): {result['ours_genai_agreement']:.0%} of rows, "
              f"{result['ours_genai_identical_tokens']}/{result['ours_genai_total_tokens']} tokens")
        if result["ours_genai_agreement"] < 1.0:
            print("    WARNING: ours and genai run the same graph greedily; their tokens should be identical")
    print(flush=True)


def print_table(results: list[dict]) -> None:
    header = f"{'case':<30} {'unit':<12} {'transformers':>12} {'optimum':>10} {'genai':>10} {'ctranslate2':>11} " \
             f"{'ct2 int8':>9} {'llama.cpp':>10} {'llama q8_0':>10} {'ours':>10} {'shipped':>10} " \
             f"{'ours/transf.':>12} {'ours/optimum':>12} {'ours/genai':>10} {'ours/ct2':>9} {'ours/llama':>10} " \
             f"{'shipped/optimum':>15} {'shipped/genai':>13} {'shipped/ct2':>11} {'shipped/ct2 int8':>16} " \
             f"{'shipped/llama':>13} {'shipped/llama q8_0':>18}"
    print("=" * len(header))
    print(header)
    print("-" * len(header))
    for r in results:
        tp = {name: _fmt(r["systems"].get(name, {}).get("throughput"), ".1f") for name in SYSTEMS}
        ratios = r["ratios"]
        print(f"{r['case']:<30} {r['unit']:<12} {tp['transformers']:>12} {tp['optimum']:>10} {tp['genai']:>10} "
              f"{tp['ctranslate2']:>11} {tp['ctranslate2-int8']:>9} {tp['llama.cpp']:>10} {tp['llama.cpp-q8_0']:>10} "
              f"{tp['ours']:>10} {tp['shipped']:>10} "
              f"{_fmt(ratios['ours/transformers'], '.2f'):>12} {_fmt(ratios['ours/optimum'], '.2f'):>12} "
              f"{_fmt(ratios['ours/genai'], '.2f'):>10} {_fmt(ratios['ours/ctranslate2'], '.2f'):>9} "
              f"{_fmt(ratios['ours/llama.cpp'], '.2f'):>10} "
              f"{_fmt(ratios['shipped/optimum'], '.2f'):>15} {_fmt(ratios['shipped/genai'], '.2f'):>13} "
              f"{_fmt(ratios['shipped/ctranslate2'], '.2f'):>11} "
              f"{_fmt(ratios['shipped/ctranslate2-int8'], '.2f'):>16} {_fmt(ratios['shipped/llama.cpp'], '.2f'):>13} "
              f"{_fmt(ratios['shipped/llama.cpp-q8_0'], '.2f'):>18}")
    print("=" * len(header))


def environment(runtime: Runtime) -> dict:
    versions = {}
    for package in ("numpy", "onnxruntime", "torch", "transformers", "optimum", "optimum.onnxruntime"):
        try:
            module = __import__(package, fromlist=["__name__"])
            versions[package] = getattr(module, "__version__", "installed")
        except ImportError:
            versions[package] = None
    from importlib.metadata import version

    for distribution in ("optimum-onnx", "onnxruntime-genai"):
        try:
            versions[distribution] = version(distribution)
        except Exception:  # noqa: BLE001 - not installed
            versions[distribution] = None
    for distribution in ("ctranslate2", "gguf"):
        try:
            versions[distribution] = version(distribution)
        except Exception:  # noqa: BLE001 - not installed
            versions[distribution] = None
    versions["llama.cpp"] = llama_cpp_version()  # make llama-cpp's build, None while there is none
    return {"python": platform.python_version(), "machine": platform.machine(), "cpu": cpu(),
            "cpu_count": os.cpu_count(), "threads": runtime.threads, "spin": runtime.spin,
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"), "load_average": os.getloadavg(),
            "executable": sys.executable, "versions": versions}
