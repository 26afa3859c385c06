"""Time an engine's calls from the outside, with `perf_counter` around each (no profiler, so the Python around the
calls is not over-counted): `timed_calls` for any functions reached through an attribute (a module's, an
object's), `timed_session_runs` for every `run` and `run_with_iobinding` of ONNX Runtime sessions; and
`operator_profile`, ONNX Runtime's own profile of those sessions summed per operator type. Shared by the profiling
scripts (`profile_translation.py`, `profile_gpt.py`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
import json
from pathlib import Path
import time

SESSION_RUNS = ("run", "run_with_iobinding")
NODE_SUFFIX = "_kernel_time"  # ONNX Runtime's profiler: one event per node run, named <node>_kernel_time
_ABSENT = object()  # the attribute was not the target's own (an instance reading its class's method)


@contextmanager
def timed_calls(targets: Iterable[tuple[object, str]]) -> Iterator[list[float]]:
    """While inside: each call of `getattr(target, name)` for the (target, name) pairs, made through that
    attribute, appends its seconds to the yielded list; on leaving, every attribute is as it was."""
    seconds: list[float] = []
    patched = []
    for target, name in targets:
        original = getattr(target, name)

        def timed(*args, _original=original, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                seconds.append(time.perf_counter() - started)

        patched.append((target, name, vars(target).get(name, _ABSENT)))
        setattr(target, name, timed)
    try:
        yield seconds
    finally:
        for target, name, own in reversed(patched):
            if own is _ABSENT:
                delattr(target, name)
            else:
                setattr(target, name, own)


def timed_session_runs(sessions: Iterable[object | None]):
    """`timed_calls` over each session's `SESSION_RUNS` (None entries and repeated sessions are skipped)."""
    return timed_calls((session, name) for session in _unique(sessions) for name in SESSION_RUNS)


def _unique(sessions: Iterable[object | None]) -> list:
    """`sessions` less the None entries and the repeats (an engine's sessions may be the same object)."""
    return list({id(s): s for s in sessions if s is not None}.values())


def operator_profile(sessions: Iterable[object | None], first: object | None = None
                     ) -> tuple[dict[str, float], int, float]:
    """End the profiles of `sessions` (made with `RuntimeOptions.profile_prefix`; None entries and repeats skipped)
    and sum their node times per operator type: (op -> us, runs, us in session runs). The first run of `first`
    (e.g. a GPT's prompt pass) is left out."""
    by_operator: dict[str, float] = defaultdict(float)
    runs, run_us = 0, 0.0
    for session in _unique(sessions):
        events = json.loads(Path(session.end_profiling()).read_text())
        model_runs = sorted((e for e in events if e.get("cat") == "Session" and e["name"] == "model_run"),
                            key=lambda e: e["ts"])
        skip = model_runs[0] if session is first and model_runs else None
        if skip is not None:
            model_runs = model_runs[1:]
        runs += len(model_runs)
        run_us += sum(e["dur"] for e in model_runs)
        for e in events:
            if e.get("cat") != "Node" or not e["name"].endswith(NODE_SUFFIX):
                continue
            if skip is not None and skip["ts"] <= e["ts"] <= skip["ts"] + skip["dur"]:
                continue
            by_operator[e["args"]["op_name"]] += e["dur"]
    return by_operator, runs, run_us
