"""The check's report: one JSON (`build`, schema `SCHEMA`) and its text rendering (`render`), written together as
reports/gpu_check.json and reports/gpu_check.txt. It holds the host (GPU name, driver and memory from nvidia-smi or
"absent" with the reason; the CPU model), ONNX Runtime's version and providers, every step with its status and
reason, and the engine benchmark's CUDA/CPU ratios (None where either side did not run)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from .steps import FAILED, Step

SCHEMA = 1
REPORT_KEYS = ("schema", "created", "ok", "command", "host", "onnxruntime", "cuda_in_use", "steps", "ratios")
STEP_KEYS = ("name", "status", "reason", "seconds", "timeout_s", "details")


def ratios(steps: dict[str, Step]) -> dict[str, dict]:
    """Per engine benchmark case: CUDA's and CPU's throughput and CUDA/CPU (None unless both ran)."""
    cpu, cuda = (steps[f"bench-engine-{device}"].details.get("cases", {}) for device in ("cpu", "cuda"))
    table = {}
    for case in dict.fromkeys([*cpu, *cuda]):
        a, b = cuda.get(case, {}).get("throughput"), cpu.get(case, {}).get("throughput")
        unit = (cuda.get(case) or cpu.get(case))["unit"]
        table[case] = {"unit": unit, "cuda": a, "cpu": b, "cuda/cpu": a / b if a and b else None}
    return table


def build(steps: dict[str, Step], probe: dict, command: str) -> dict:
    gpu = probe.get("gpu") or {"present": False, "why": "the environment step did not run"}
    cpu = probe.get("cpu") or {}
    return {
        "schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "ok": not any(step.status == FAILED for step in steps.values()), "command": command,
        "host": {"gpu": gpu, "cpu": cpu.get("model"), "cpu_isa": cpu.get("isa"), "python": probe.get("python")},
        "onnxruntime": probe.get("onnxruntime"), "cuda_in_use": bool(probe.get("cuda_in_use")),
        "steps": [{key: getattr(step, key) for key in STEP_KEYS} for step in steps.values()],
        "ratios": ratios(steps),
    }


def _number(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def render(report: dict) -> str:
    gpu = report["host"]["gpu"]
    gpus = "; ".join(f"{g['name']}, driver {g['driver_version']}, {g['memory.total']}" for g in gpu["gpus"]) \
        if gpu["present"] else f"absent ({gpu['why']})"
    ort = report["onnxruntime"] or {}
    lines = [f"gpu-check {report['created']}: {'OK' if report['ok'] else 'FAILED'}",
             f"GPU: {gpus}",
             f"CPU: {report['host']['cpu'] or 'unknown'}",
             f"Python {report['host']['python'] or '?'}; onnxruntime {ort.get('version')} "
             f"({', '.join(f'{k} {v}' for k, v in (ort.get('distributions') or {}).items())}), "
             f"providers {', '.join(ort.get('providers') or [])}; CUDA in use: {report['cuda_in_use']}",
             "", "steps:"]
    for step in report["steps"]:
        lines.append(f"  {step['name']:<18} {step['status']:<8} {step['seconds']:6.1f} s  {step['reason']}")
    lines += ["", "engine benchmark, CUDA / CPU:"]
    for case, row in report["ratios"].items():
        lines.append(f"  {case:<32} cuda {_number(row['cuda'])}  cpu {_number(row['cpu'])} {row['unit']}  "
                     f"cuda/cpu {_number(row['cuda/cpu'], 2)}")
    if not report["ratios"]:
        lines.append("  n/a (the engine benchmark did not run)")
    return "\n".join(lines) + "\n"


def write(report: dict, folder: Path, name: str = "gpu_check") -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    as_json, as_text = folder / f"{name}.json", folder / f"{name}.txt"
    as_json.write_text(json.dumps(report, indent=2) + "\n")
    as_text.write_text(render(report))
    return as_json, as_text
