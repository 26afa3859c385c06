"""The systems by name and task (`BUILDERS`), and building the ones asked for: a system whose package is missing
or that does not apply to a task is skipped, with the reason."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from .baselines import (
    run_genai_gpt,
    run_optimum_gpt,
    run_optimum_translation,
    run_transformers_gpt,
    run_transformers_translation,
)
from .ct2 import run_ctranslate2_translation
from .llama_cpp import SYSTEM_FILE_TYPES, run_llama_cpp_gpt
from .ours import run_ours_gpt, run_ours_translation, run_shipped_gpt, run_shipped_translation
from .workloads import GenerateFn, Runtime

# ctranslate2-int8: CTranslate2's int8 (int8 weights and GEMMs, its `compute_type="int8"`), the peer of a shipped
# variant with int8 weights (MatMulNBits with int8 compute), where the float32 ctranslate2 is the peer of equal outputs;
# llama.cpp-q8_0 likewise: llama.cpp on the same GGUF with its matmul weights in its int8 format, q8_0 (issue 56)
SYSTEMS = ("transformers", "optimum", "genai", "ctranslate2", "ctranslate2-int8", "llama.cpp", "llama.cpp-q8_0",
           "ours", "shipped")
BUILDERS: dict[str, dict[str, Callable[..., GenerateFn]]] = {
    "gpt": {"transformers": run_transformers_gpt, "optimum": run_optimum_gpt, "genai": run_genai_gpt,
            **{name: partial(run_llama_cpp_gpt, file_type=file_type) for name, file_type in SYSTEM_FILE_TYPES.items()},
            "ours": run_ours_gpt, "shipped": run_shipped_gpt},
    "translation": {"transformers": run_transformers_translation, "optimum": run_optimum_translation,
                    "ctranslate2": run_ctranslate2_translation,
                    "ctranslate2-int8": partial(run_ctranslate2_translation, compute_type="int8"),
                    "ours": run_ours_translation,
                    "shipped": run_shipped_translation},
}


def build_systems(task: str, spec, systems: list[str], runtime: Runtime, workdir: Path):
    """Build each system; one that cannot be built (missing package, not implemented) is skipped with a reason."""
    built, skipped = {}, {}
    for name in systems:
        if name not in BUILDERS[task]:
            skipped[name] = f"not applicable to {task}"
            print(f"  [{task}] {name}: skipped ({skipped[name]})", flush=True)
            continue
        start = time.perf_counter()
        try:
            built[name] = BUILDERS[task][name](spec, runtime, workdir)
        except (ImportError, NotImplementedError) as error:
            skipped[name] = f"{type(error).__name__}: {error}"
            print(f"  [{task}] {name}: skipped ({skipped[name]})", flush=True)
            continue
        print(f"  [{task}] {name}: built in {time.perf_counter() - start:.1f} s", flush=True)
    return built, skipped
