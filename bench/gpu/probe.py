"""What this host offers the CUDA path, read from the tools themselves: the GPU from `nvidia-smi` (name, driver,
memory; "absent" with the reason when there is none), ONNX Runtime's version and providers, and whether a session
asked for CUDA really runs on it (`session.get_providers()[0]`: ONNX Runtime falls back to CPU silently when the
CUDA libraries or the device are missing).

Standard library only at import (onnxruntime is imported when asked), so that `python bench/gpu/probe.py` prints the
JSON of `describe()` under whichever interpreter runs it: the check's venv on the GPU machine.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
NVIDIA_SMI_QUERY = ("name", "driver_version", "memory.total")
NVIDIA_SMI_TIMEOUT_S = 20
# the smallest committed graph (1.1 MB, every op on CUDA): a session of it shows which provider really runs
PROBE_GRAPH = Path(__file__).resolve().parents[2] / "model_repository" / "vit" / "4" / "model.onnx"


def gpus() -> dict:
    """{"present": True, "gpus": [{"name", "driver_version", "memory.total"}]} or {"present": False, "why"}."""
    if shutil.which("nvidia-smi") is None:
        return {"present": False, "why": "nvidia-smi not found on PATH"}
    command = ["nvidia-smi", f"--query-gpu={','.join(NVIDIA_SMI_QUERY)}", "--format=csv,noheader"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as error:
        return {"present": False, "why": f"nvidia-smi failed: {error}"}
    rows = [[cell.strip() for cell in line.split(",")] for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or not rows:
        why = (done.stderr or done.stdout).strip().splitlines()[:1] or [f"exit status {done.returncode}"]
        return {"present": False, "why": f"nvidia-smi: {why[0]}"}
    return {"present": True, "gpus": [dict(zip(NVIDIA_SMI_QUERY, row)) for row in rows]}


def cuda_session(graph: Path = PROBE_GRAPH) -> tuple[bool, str]:
    """(True, "") when a session asked for [CUDA, CPU] runs on CUDA; else (False, why) - one line."""
    try:
        import onnxruntime as ort
    except ImportError as error:
        return False, f"onnxruntime is not installed ({error})"
    available = ort.get_available_providers()
    if CUDA not in available:
        return False, f"onnxruntime {ort.__version__} has no {CUDA} (providers: {', '.join(available)})"
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: the fallback warning is what this function reports
    try:
        session = ort.InferenceSession(str(graph), sess_options=options, providers=[CUDA, CPU])
    except Exception as error:  # noqa: BLE001 - any failure to start is the answer
        return False, f"a CUDA session of {graph.name} did not start: {str(error).splitlines()[0]}"
    active = session.get_providers()[0]
    if active != CUDA:
        return False, f"a session asked for CUDA runs on {active} (no GPU visible, or the CUDA libraries missing)"
    return True, ""


def onnxruntime_info() -> dict:
    try:
        import onnxruntime as ort
    except ImportError as error:
        return {"version": None, "providers": [], "package": None, "why": str(error)}
    from importlib.metadata import PackageNotFoundError, version

    packages = {}
    for name in ("onnxruntime-gpu", "onnxruntime"):
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            pass
    return {"version": ort.__version__, "providers": ort.get_available_providers(), "distributions": packages,
            "module": str(Path(ort.__file__).parent)}


def describe() -> dict:
    usable, why = cuda_session()
    return {"python": sys.version.split()[0], "executable": sys.executable, "gpu": gpus(),
            "onnxruntime": onnxruntime_info(), "cuda_in_use": usable, "cuda_why_not": why}


if __name__ == "__main__":
    print(json.dumps(describe()))
