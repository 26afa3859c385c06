"""ONNX Runtime sessions: provider preference (CUDA first when present, else CPU), threads, graph optimisation,
and the weights variant the graph runs in (`service.engines.weights`: derived from the stored graph when it differs).

The provider actually in use is read back from the session (ONNX Runtime silently falls back to CPU when CUDA
cannot start) and logged, so `/v1/models` and the metrics report what really runs.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import onnxruntime as ort

from service.engines.device_ops import DeviceOps, Placement
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
    # several decoding workers share the engine (TSERVE_DECODING_WORKERS > 1): a decoder call made while another is
    # in flight runs on the one-thread session too, whatever its rows (`OneThreadSession.call`)
    one_thread_when_concurrent: bool = False
    # the variant the sessions run (`service.engines.weights.VARIANTS`: the MatMul weights, fp32 or int8, and with
    # `+gqa` the step graph's attention as GroupQueryAttention), derived from the stored graph where it differs;
    # None = as stored
    weights: str | None = None
    # the sibling projections (MatMuls reading one input: Q/K/V) run as one MatMul
    # (`service.engines.projection_fusion`); the same outputs bit for bit, fewer kernel calls
    fuse_projections: bool = True
    # the GPT's prompt K/V kept for prompts that start alike (`service.engines.prefix_cache`), in at most this
    # many bytes; 0 = none
    prefix_cache_bytes: int = 0
    # ONNX Runtime's node profiler on every session, its JSON written under this path prefix when a session's
    # `end_profiling()` is called (bench/profile_gpt.py); None = off, as a server runs
    profile_prefix: str | None = None
    # where the decoders' KV caches live (`kv_resident_on_device`): auto (in the provider's memory under CUDA, numpy
    # on the host under the CPU provider, where binding numpy by address measured faster) | device | host
    kv_residence: str = "auto"


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


KV_RESIDENCES = ("auto", "device", "host")


def kv_resident_on_device(options: RuntimeOptions, provider: str) -> bool:
    """Whether a decoder's KV cache lives in the provider's memory (`service.engines.device_cache`) rather than in
    numpy arrays on the host: `device` always, `host` never, `auto` under CUDA only (every step would otherwise copy
    the whole cache to the GPU and its presents back)."""
    if options.kv_residence not in KV_RESIDENCES:
        raise ValueError(f"kv_residence must be one of {', '.join(KV_RESIDENCES)}, got {options.kv_residence!r}")
    return options.kv_residence == "device" or (options.kv_residence == "auto" and provider == CUDA)


def placement_of(session: ort.InferenceSession) -> Placement:
    """Where a session's provider keeps its tensors: CUDA's device (its `device_id` option), or the CPU."""
    if active_provider(session) != CUDA:
        return Placement()
    return Placement("cuda", int(session.get_provider_options().get(CUDA, {}).get("device_id", 0)))


def device_ops_for(session: ort.InferenceSession, options: RuntimeOptions) -> DeviceOps | None:
    """The device operations of a decoder whose KV cache lives on the device (`kv_resident_on_device`), on the
    session's own providers and device; None when it lives on the host."""
    if not kv_resident_on_device(options, active_provider(session)):
        return None
    provider_options = session.get_provider_options()
    providers = [(name, provider_options.get(name, {})) for name in session.get_providers()]
    return DeviceOps(providers, placement_of(session), session_options(replace(options, profile_prefix=None)))


def session_options(options: RuntimeOptions) -> ort.SessionOptions:
    """ONNX Runtime's session options for `options`: threads, spinning, optimisation level, log level, profiling."""
    settings = ort.SessionOptions()
    settings.intra_op_num_threads = options.intra_op_threads
    settings.inter_op_num_threads = options.inter_op_threads
    settings.graph_optimization_level = _LEVELS[options.graph_optimization]
    settings.log_severity_level = ORT_LOG_ERRORS_ONLY
    spin = "1" if options.spin else "0"
    settings.add_session_config_entry("session.intra_op.allow_spinning", spin)
    settings.add_session_config_entry("session.inter_op.allow_spinning", spin)
    if options.profile_prefix:
        settings.enable_profiling = True
        settings.profile_file_prefix = options.profile_prefix
    return settings


def create_session(path: str | Path, options: RuntimeOptions = RuntimeOptions(), row_candidates: bool = False
                   ) -> ort.InferenceSession:
    """A session of the graph at `path` in `options.weights`; `row_candidates`: with the decoder's row candidates
    added (`service.engines.row_candidates`)."""
    settings = session_options(options)
    derived = (derive(path, options.weights, row_candidates, options.fuse_projections)
               if options.weights or row_candidates or options.fuse_projections else None)
    graph = str(path) if derived is None else derived
    session = ort.InferenceSession(graph, sess_options=settings, providers=preferred_providers(options.device))
    active = session.get_providers()[0]
    if options.device == "cuda" and active != CUDA:
        log.warning("CUDA provider did not start for %s (no GPU visible?); falling back to %s", path, active)
    extra = (", with row candidates" if row_candidates else "") + (
        ", sibling projections fused where any" if options.fuse_projections else "")
    note = "" if derived is None else f" (derived: {options.weights or 'stored'} variant{extra})"
    log.info("loaded %s on %s%s", path, active, note)
    return session


def active_provider(session: ort.InferenceSession) -> str:
    return session.get_providers()[0]


# With several decoding workers (`RuntimeOptions.one_thread_when_concurrent`), a call counts as concurrent when another
# thread's call of the same engine is in flight or ended less than this long ago: a busy worker's calls are apart by
# its searches and bookkeeping (a millisecond or two), so two busy workers keep a core each all along, where "in
# flight right now" alone let whichever call started first take every thread while the other worker's next call
# started beside it (three threads on two cores). A worker left alone gets every thread back this long after the
# other's last call.
CONCURRENT_WINDOW_S = 0.05


class EngineCalls:
    """The ONNX Runtime calls of one engine in flight now and when each thread's last one ended, shared by the
    engine's `OneThreadSession`s (its prompt pass or encoder, and its steps): `enter()`, at the start of a call,
    says whether another thread's call is running or ended within `window_s`; `exit()` at its end. The threads
    that call an engine are few (its decoding workers, the model loader, the scoring routes' worker pool)."""

    def __init__(self, window_s: float = CONCURRENT_WINDOW_S):
        self.window_s = window_s
        self._in_flight = 0
        # thread id -> when its last call ended (time.monotonic()), for the threads whose last call ended within the
        # window: older ones are dropped at the next call (worker pools replace their threads)
        self._ended: dict[int, float] = {}
        self._lock = threading.Lock()

    def enter(self) -> bool:
        """A call starts on this thread -> whether it runs beside another thread's."""
        me, now = threading.get_ident(), time.monotonic()
        with self._lock:
            self._ended = {thread: ended for thread, ended in self._ended.items() if now - ended < self.window_s}
            concurrent = self._in_flight > 0 or any(thread != me for thread in self._ended)
            self._in_flight += 1
        return concurrent

    def exit(self) -> None:
        with self._lock:
            self._in_flight -= 1
            self._ended[threading.get_ident()] = time.monotonic()


class OneThreadSession:
    """With ``single_thread_rows`` on, a second session of a decoder graph with one intra-op thread, for the calls
    of at most that many rows (`pick`); none on CUDA or when the sessions have one thread anyway. ONNX Runtime
    sets threads per session, not per run; a one-row step is ~100 small ops, and with non-spinning threads
    (`RuntimeOptions.spin`) waking a second thread for each costs more than it saves (the release GPT at batch 1
    on an AMD EPYC, 2 cores: 1,111 tokens/s on one thread, 890 on two; from batch 16 two threads win by
    1.3-1.4x; `bench/bench_engine.py --threads`).

    With ``one_thread_when_concurrent`` (several decoding workers on one engine), a call made beside another of
    this engine's calls (`EngineCalls`, shared by the engine's sessions: its prompt pass or encoder and its steps)
    runs on the one-thread session whatever its rows: two calls on one session share its intra-op pool and take
    more threads than there are cores, where two one-thread calls each keep a core. A lone call keeps every
    thread: a worker alone with a large batch loses up to a quarter of its speed on one thread. Measured over HTTP
    on 2 cores, 2 workers (docs/benchmarks.md): counting calls in flight only, against the same checkout without
    the rule, 5 of 6 interleaved pairs in its favour, +4-5% on the means (translation, 16 clients; the GPT, 32
    streams); counting recent calls and the prompt passes too (with idle workers leaving a request to the first
    idle one, `ContinuousBatcher._defers`), 5 of 6 pairs in its favour at 32 streams, 0.90-1.25x, geometric mean
    1.10x (the GPT). Each session's outputs are bit-identical (tests/unit/engines/test_one_thread_session.py)."""

    def __init__(self, path: str | Path, options: RuntimeOptions, wide: ort.InferenceSession,
                 row_candidates: bool = False, calls: EngineCalls | None = None):
        self.max_rows = options.single_thread_rows
        self.when_concurrent = options.one_thread_when_concurrent
        needed = ((self.max_rows > 0 or self.when_concurrent) and options.intra_op_threads != 1
                  and active_provider(wide) == CPU)
        self.session = (create_session(path, replace(options, intra_op_threads=1), row_candidates) if needed
                        else None)
        self.calls = calls or EngineCalls()  # this engine's calls (`EngineCalls`), shared with its other sessions

    @classmethod
    def beside_others(cls, path: str | Path, options: RuntimeOptions, wide: ort.InferenceSession,
                      calls: EngineCalls) -> OneThreadSession:
        """For a graph run as a whole pass (the GPT's prompt pass, the translator's encoder pass): every thread
        alone, one beside another worker's call, whatever its rows (no `single_thread_rows` rule)."""
        return cls(path, replace(options, single_thread_rows=0), wide, calls=calls)

    def pick(self, rows: int, wide: ort.InferenceSession, concurrent: bool = False) -> ort.InferenceSession:
        """The session a call of ``rows`` rows runs on: this one for small calls (and, with
        ``one_thread_when_concurrent``, for a call beside another), else ``wide``."""
        if self.session is None:
            return wide
        return self.session if rows <= self.max_rows or (concurrent and self.when_concurrent) else wide

    def call(self, rows: int, wide: ort.InferenceSession) -> _Call:
        """`pick` for a call about to run, counted as in flight until the ``with`` block ends: ``with
        one_thread.call(rows, wide) as session: session.run(...)``."""
        return _Call(self, rows, wide)


class _Call:
    """`OneThreadSession.call`'s context: a class, not a generator, since it wraps every decoding step (a
    generator-based context manager costs a step ~2 us)."""

    __slots__ = ("owner", "rows", "wide")

    def __init__(self, owner: OneThreadSession, rows: int, wide: ort.InferenceSession):
        self.owner, self.rows, self.wide = owner, rows, wide

    def __enter__(self) -> ort.InferenceSession:
        return self.owner.pick(self.rows, self.wide, self.owner.calls.enter())

    def __exit__(self, *exc) -> None:
        self.owner.calls.exit()
