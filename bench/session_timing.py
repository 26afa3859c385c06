"""Time an engine's ONNX Runtime calls from the outside: every `run` and `run_with_iobinding` of the given sessions,
with `perf_counter` around it (no profiler, so the Python around the calls is not over-counted). Shared by the
profiling scripts (`profile_translation.py`, `profile_gpt.py`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
import time

SESSION_RUNS = ("run", "run_with_iobinding")


@contextmanager
def timed_session_runs(sessions: Iterable[object | None]) -> Iterator[list[float]]:
    """While inside: each call of a session's `SESSION_RUNS` appends its seconds to the yielded list (None entries
    and repeated sessions are skipped)."""
    seconds: list[float] = []
    unique = {id(s): s for s in sessions if s is not None}
    patched = []
    for session in unique.values():
        for name in SESSION_RUNS:
            original = getattr(session, name)

            def timed(*args, _original=original, **kwargs):
                started = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    seconds.append(time.perf_counter() - started)

            setattr(session, name, timed)
            patched.append((session, name))
    try:
        yield seconds
    finally:
        for session, name in patched:
            delattr(session, name)
