"""The CPU a benchmark ran on, printed first and recorded by every benchmark (`bench_engine.py`, `bench_http.py`):
ONNX Runtime picks other kernels on other CPUs (AVX2, AVX-512, VNNI, AMX), so a figure holds only beside its CPU."""

from __future__ import annotations

import os
import platform
import subprocess

# the lscpu flags that change which kernels ONNX Runtime (and CTranslate2, llama.cpp) run
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8")
LSCPU_TIMEOUT_S = 10


def cpu() -> dict:
    """The CPU model, its cores and the vector ISA extensions that change ONNX Runtime's kernels (from lscpu, else
    /proc/cpuinfo): every figure holds only beside the CPU it ran on."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=LSCPU_TIMEOUT_S).stdout
    except (OSError, subprocess.SubprocessError):
        text = ""
    if not text and os.path.exists("/proc/cpuinfo"):
        text = open("/proc/cpuinfo").read().replace("model name", "Model name").replace("flags", "Flags")
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name" and value.strip():
            model = value.strip()
        elif key.strip() == "Flags":
            flags = set(value.split())
    isa = [f for f in ISA_FLAGS if f in flags]
    return {"model": model, "cores": os.cpu_count(), "isa": isa}


def describe() -> str:
    """One line: the model, the cores and the ISA extensions found."""
    info = cpu()
    return f"CPU: {info['model']} ({info['cores']} cores; ISA: {' '.join(info['isa']) or '-'})"
