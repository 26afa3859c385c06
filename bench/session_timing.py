"""Time an engine's calls from the outside, with `perf_counter` around each (no profiler, so the Python around the
calls is not over-counted): `timed_calls` for any functions reached through an attribute (a module's, an
object's), `timed_session_runs` for every `run` and `run_with_iobinding` of ONNX Runtime sessions. Shared by the
profiling scripts (`profile_translation.py`, `profile_gpt.py`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
import time

SESSION_RUNS = ("run", "run_with_iobinding")
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
    unique = {id(s): s for s in sessions if s is not None}
    return timed_calls((session, name) for session in unique.values() for name in SESSION_RUNS)
