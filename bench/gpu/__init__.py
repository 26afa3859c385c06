"""The parts of bench/gpu_check.py (`make gpu-check`: the CUDA path proved on one NVIDIA machine, one report):

- wheels.py: the offline wheel folder (`make gpu-wheels` fills it): onnxruntime-gpu split into parts and put back
  together, every wheel's sha256 checked against the locks, the venv installed from it with no index;
- probe.py: what this host has: the GPU (nvidia-smi), ONNX Runtime's version and providers, whether a CUDA session
  really runs on CUDA;
- steps.py: the check's steps, each a subprocess under its own timeout, each passed, failed or skipped with a reason;
- report.py: the report (reports/gpu_check.json and .txt) and the CUDA/CPU ratios.
"""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
