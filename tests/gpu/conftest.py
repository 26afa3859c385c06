"""tests/gpu: the CUDA path on a real GPU, `pytest -m gpu tests/gpu` (`make gpu-check` runs it). Every module here
marks its tests `gpu`; every test is skipped with one line, "needs a CUDA GPU: <why>", unless onnxruntime has the
CUDAExecutionProvider and a session asked for it really runs on it (`session.get_providers()[0]`: ONNX Runtime
falls back to CPU silently), as bench/gpu/probe.py finds on the smallest committed graph. Allowed under CI
(tests/support/skips.py): CI has no GPU."""

from __future__ import annotations

import functools
import sys

import pytest

from tests.support import ROOT

NEEDS_GPU = "needs a CUDA GPU: "

if str(ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(ROOT / "bench"))


@functools.cache
def cuda_status() -> tuple[bool, str]:
    """(True, "") when CUDA really runs here, else (False, why); probed once per session."""
    from gpu.probe import cuda_session

    return cuda_session()


def pytest_runtest_setup(item):
    """Only for the tests under tests/gpu (a conftest's run-test hooks apply to its folder)."""
    usable, why = cuda_status()
    if not usable:
        pytest.skip(NEEDS_GPU + why)
