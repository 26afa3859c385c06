"""Timing the systems alike: warm-up, then repeats interleaved round-robin across systems (a background load that
drifts over time hits them all alike), the output shapes checked (every system generates exactly as many tokens),
and the summary of a case: median throughput, ratios with their spread over the rounds (each round's ratio from
that round's two passes: one system misbehaving in one round shows as spread, not as the ratio), the machine's load
before and after, and how often two systems on the same weights agree."""

from __future__ import annotations

import statistics
import time

import numpy as np
from spread import judge, ratio_spread, sampled_load

from .llama_cpp import agreement as llama_cpp_agreement
from .workloads import GenerateFn

# the C++ peers of ours and shipped, each ratio `<ours|shipped>/<peer>` (llama.cpp-q8_0: its int8 format, issue 56)
PEERS = ("transformers", "optimum", "genai", "ctranslate2", "ctranslate2-int8", "llama.cpp", "llama.cpp-q8_0")
# issue 56's goals, (op, threshold) per ratio, whatever the batch: shipped ahead of the C++ engines in their float32
# and int8 formats, ours ahead of ONNX Runtime GenAI on the same float32 graph
GOALS = {"shipped/ctranslate2": (">=", 1.3), "shipped/ctranslate2-int8": (">=", 1.3),
         "shipped/llama.cpp": (">=", 1.3), "shipped/llama.cpp-q8_0": (">=", 1.0), "ours/genai": (">=", 1.1)}


def measure(systems: dict[str, GenerateFn], inputs: list[np.ndarray], expected_new: int, warmup: int,
            repeats: int, skipped: dict[str, str] | None = None
            ) -> tuple[dict[str, list[float]], dict[str, list[np.ndarray]]]:
    """Seconds to run every input through each system, per repeat, repeats interleaved across systems.
    Also checks that each system produced exactly `expected_new` tokens per row. With `skipped`, a system that
    cannot run this case (its untimed pass raises: e.g. ONNX Runtime GenAI refuses batches above 32) is left out
    of it and its reason recorded there; without, the error propagates."""
    outputs: dict[str, list[np.ndarray]] = {}
    for name, generate in list(systems.items()):
        try:
            for _ in range(max(warmup, 1)):  # at least one untimed pass: it also yields the outputs checked below
                outputs[name] = [np.asarray(generate(x)) for x in inputs]
        except Exception as error:
            if skipped is None:
                raise
            skipped[name] = f"{type(error).__name__}: {error}"
            print(f"    {name}: skipped in this case ({skipped[name]})", flush=True)
            systems = {other: fn for other, fn in systems.items() if other != name}
            outputs.pop(name, None)
            continue
        for x, y in zip(inputs, outputs[name]):
            if y.shape != (x.shape[0], expected_new):
                raise RuntimeError(f"{name} returned shape {y.shape}, expected {(x.shape[0], expected_new)}: "
                                   "every system must generate exactly the same number of tokens")
    times: dict[str, list[float]] = {name: [] for name in systems}
    with sampled_load(LOADS):
        for _ in range(repeats):
            for name, generate in systems.items():
                start = time.perf_counter()
                for x in inputs:
                    generate(x)
                times[name].append(time.perf_counter() - start)
    return times, outputs


# the 1-minute load average before and after each `measure`'s timed rounds, in call order (`summarise` takes the last)
LOADS: list[tuple[float, float]] = []


def agreement(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """Fraction of output rows that are identical (transformers vs Optimum share weights, and so do ours vs
    genai (one graph file), so ~1.0 expected; near-ties in random-weight logits can flip a token now and then)."""
    rows_a = [row for y in a for row in y]
    rows_b = [row for y in b for row in y]
    return sum(np.array_equal(x, y) for x, y in zip(rows_a, rows_b)) / max(len(rows_a), 1)


def summarise(case: str, unit: str, work: float, times: dict[str, list[float]], outputs, skipped) -> dict:
    """`work` = tokens (or sentences) per timed pass; throughput = work / median seconds."""
    result = {"case": case, "unit": unit, "work_per_pass": work, "systems": {}, "skipped": skipped}
    for name, seconds in times.items():
        median = statistics.median(seconds)
        result["systems"][name] = {"throughput": work / median, "median_s": median,
                                   "best_throughput": work / min(seconds), "seconds": [round(s, 4) for s in seconds]}
    throughput = {name: entry["throughput"] for name, entry in result["systems"].items()}
    result["ratios"] = {
        f"{mine}/{other}": (throughput[mine] / throughput[other]) if {mine, other} <= throughput.keys() else None
        for mine in ("ours", "shipped")
        for other in PEERS
    }
    result["ratios"]["optimum/transformers"] = (throughput["optimum"] / throughput["transformers"]
                                                if {"optimum", "transformers"} <= throughput.keys() else None)
    # a round's throughput ratio mine/other is other's seconds over mine's in that round
    result["ratio_spread"] = {key: ratio_spread(times[key.split("/")[1]], times[key.split("/")[0]])
                              for key, value in result["ratios"].items() if value is not None}
    result["goals"] = {key: {"goal": f"{op} {threshold:g}", "status": judge(result["ratios"][key], (op, threshold))}
                       for key, (op, threshold) in GOALS.items() if result["ratios"].get(key) is not None}
    if LOADS:
        result["load_before_after"] = list(LOADS[-1])
    if {"transformers", "optimum"} <= outputs.keys():
        result["transformers_optimum_agreement"] = agreement(outputs["transformers"], outputs["optimum"])
    if {"ours", "ctranslate2"} <= outputs.keys():  # the same weights (enginebench.ct2): the beams should agree
        result["ours_ctranslate2_agreement"] = agreement(outputs["ours"], outputs["ctranslate2"])
    if {"shipped", "ctranslate2"} <= outputs.keys():  # the served variant against float32 (int8: not all alike)
        result["shipped_ctranslate2_agreement"] = agreement(outputs["shipped"], outputs["ctranslate2"])
    if {"ours", "llama.cpp"} <= outputs.keys():  # the same weights (enginebench.llama_cpp), its GELU approximated
        result["ours_llama_cpp_agreement"] = llama_cpp_agreement(outputs["ours"], outputs["llama.cpp"])
    if {"ours", "genai"} <= outputs.keys():
        result["ours_genai_agreement"] = agreement(outputs["ours"], outputs["genai"])
        result["ours_genai_identical_tokens"] = int(sum(
            int((x == y).sum()) for x, y in zip(outputs["ours"], outputs["genai"])))
        result["ours_genai_total_tokens"] = int(sum(x.size for x in outputs["ours"]))
    return result
