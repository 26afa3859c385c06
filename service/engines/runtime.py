"""ONNX Runtime sessions: provider preference (CUDA first when present, else CPU), threads, graph optimisation,
and the weights variant the graph runs in (`service.engines.weights`: derived from the stored graph when it differs).

The provider actually in use is read back from the session (ONNX Runtime silently falls back to CPU when CUDA
cannot start) and logged, so `/v1/models` and the metrics report what really runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import onnxruntime as ort

from service.engines.weights import derive

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
# ONNX Runtime's log severity for its own messages: 3 = errors only (0 verbose, 1 info, 2 warnings, 4 fatal);
# shape-inference chatter is not useful in service logs.
ORT_LOG_ERRORS_ONLY = 3


@dataclass(frozen=True)
class RuntimeOptions:
    """How sessions are built. `intra_op_threads=0` lets ONNX Runtime use every core.

    `spin=False` makes idle worker threads sleep instead of busy-waiting between ops: on cores shared with other
    work (a web server, other models, other containers) spinning threads wait for descheduled siblings at every
    op; ONNX Runtime's default (spinning) only pays on dedicated cores."""

    device: str = "auto"  # auto | cuda | cpu
    intra_op_threads: int = 0
    inter_op_threads: int = 1
    graph_optimization: str = "all"  # disable | basic | extended | all
    spin: bool = False
    # decoder calls of at most this many rows run on a second session with one intra-op thread (`OneThreadSession`);
    # 0 = never
    single_thread_rows: int = 0
    # the variant the sessions run (`service.engines.weights.VARIANTS`: the MatMul weights, fp32 or int8, and with
    # `+gqa` the step graph's attention as GroupQueryAttention), derived from the stored graph where it differs;
    # None = as stored
    weights: str | None = None


# Each model kind's `single_thread_rows` unless TSERVE_SINGLE_THREAD_ROWS sets one for all (service.models.kinds;
# `OneThreadSession`): the GPT's one-row steps ran 1.24x faster on one thread, translation's four-row beam steps
# 0.62x, and no faster than two threads once its candidates came from the graph (AMD EPYC, 2 cores;
# docs/benchmarks.md). Here, not in the kinds table, so that bench-engine's venv (no web stack) can read it.
DEFAULT_SINGLE_THREAD_ROWS = {"translation": 0, "gpt": 1}


_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def preferred_providers(device: str = "auto") -> list[str]:
    available = ort.get_available_providers()
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be auto, cuda or cpu, got {device!r}")
    if device == "cpu":
        return [CPU]
    if CUDA in available:
        return [CUDA, CPU]
    if device == "cuda":
        log.warning("device=cuda asked for, but this onnxruntime build has no CUDA provider; using CPU")
    return [CPU]


def create_session(path: str | Path, options: RuntimeOptions = RuntimeOptions(), row_candidates: bool = False
                   ) -> ort.InferenceSession:
    """A session of the graph at `path` in `options.weights`; `row_candidates`: with the decoder's row candidates
    added (`service.engines.row_candidates`)."""
    settings = ort.SessionOptions()
    settings.intra_op_num_threads = options.intra_op_threads
    settings.inter_op_num_threads = options.inter_op_threads
    settings.graph_optimization_level = _LEVELS[options.graph_optimization]
    settings.log_severity_level = ORT_LOG_ERRORS_ONLY
    spin = "1" if options.spin else "0"
    settings.add_session_config_entry("session.intra_op.allow_spinning", spin)
    settings.add_session_config_entry("session.inter_op.allow_spinning", spin)
    derived = derive(path, options.weights, row_candidates) if options.weights or row_candidates else None
    graph = str(path) if derived is None else derived
    session = ort.InferenceSession(graph, sess_options=settings, providers=preferred_providers(options.device))
    active = session.get_providers()[0]
    if options.device == "cuda" and active != CUDA:
        log.warning("CUDA provider did not start for %s (no GPU visible?); falling back to %s", path, active)
    extra = ", with row candidates" if row_candidates else ""
    note = "" if derived is None else f" (derived: {options.weights or 'stored'} variant{extra})"
    log.info("loaded %s on %s%s", path, active, note)
    return session


def active_provider(session: ort.InferenceSession) -> str:
    return session.get_providers()[0]


class OneThreadSession:
    """With ``single_thread_rows`` on, a second session of a decoder graph with one intra-op thread, for the calls
    of at most that many rows (`pick`); none on CUDA or when the sessions have one thread anyway. ONNX Runtime
    sets threads per session, not per run; a one-row step is ~100 small ops, and with non-spinning threads
    (`RuntimeOptions.spin`) waking a second thread for each costs more than it saves (the release GPT at batch 1
    on an AMD EPYC, 2 cores: 1,111 tokens/s on one thread, 890 on two; from batch 16 two threads win by
    1.3-1.4x; `bench/bench_engine.py --threads`)."""

    def __init__(self, path: str | Path, options: RuntimeOptions, wide: ort.InferenceSession,
                 row_candidates: bool = False):
        self.max_rows = options.single_thread_rows
        needed = self.max_rows > 0 and options.intra_op_threads != 1 and active_provider(wide) == CPU
        self.session = (create_session(path, replace(options, intra_op_threads=1), row_candidates) if needed
                        else None)

    def pick(self, rows: int, wide: ort.InferenceSession) -> ort.InferenceSession:
        """The session a call of ``rows`` rows runs on: this one for small calls, else ``wide``."""
        return self.session if self.session is not None and rows <= self.max_rows else wide
