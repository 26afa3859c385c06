"""bench-engine's CTranslate2 peer runs at the faster of its thread settings for each batch size
(`enginebench.ct2.ThreadChoice`): both settings timed on the first call of a size, the faster kept for every later
call of that size, each size chosen on its own, every call answered by a worker; no CTranslate2 needed (stand-in
workers whose speed is set per thread count)."""

from __future__ import annotations

import sys
import time

from tests.support import ROOT

BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from enginebench import ct2  # noqa: E402 - after the sys.path set-up

DELAY_S = 0.05  # a slow worker's extra time per call: far above timer and scheduling noise on a busy machine


class SlowOrFast:
    """A stand-in `Worker`: `slow_at(batch)` says whether this thread count is the slow one for that batch."""

    made: dict[int, SlowOrFast] = {}

    def __init__(self, folder, compute_type, threads):
        self.threads, self.calls, self.closed = threads, [], False
        SlowOrFast.made[threads] = self

    def slow_at(self, batch: int) -> bool:
        return (self.threads == 1) == (batch > 1)  # 1 thread wins batch 1, 2 threads win larger batches

    def translate(self, sources, num_beams, new_tokens):
        self.calls.append(len(sources))
        if self.slow_at(len(sources)):
            time.sleep(DELAY_S)
        return [[self.threads] * new_tokens for _ in sources]

    def close(self):
        self.closed = True


def test_each_batch_size_runs_on_its_faster_thread_setting(monkeypatch, tmp_path):
    monkeypatch.setattr(ct2, "Worker", SlowOrFast)
    SlowOrFast.made = {}
    choice = ct2.ThreadChoice(tmp_path, "int8", threads=2)
    assert sorted(SlowOrFast.made) == [1, 2]
    assert choice.translate([[5, 2]], 4, 3) == [[1, 1, 1]]  # batch 1: the one-thread worker's answer
    assert choice.translate([[5, 2]] * 4, 4, 3) == [[2, 2, 2]] * 4  # batch 4: two threads
    assert choice.translate([[6, 2]], 4, 3) == [[1, 1, 1]]
    assert {batch: c["threads"] for batch, c in choice.choices.items()} == {1: 1, 4: 2}
    assert set(choice.choices[1]["median_s"]) == {1, 2}
    one, two = SlowOrFast.made[1], SlowOrFast.made[2]
    # each first call of a size: PROBES runs on each worker (the answer is the chosen one's last); later calls: one
    assert one.calls == [1] * ct2.ThreadChoice.PROBES + [4] * ct2.ThreadChoice.PROBES + [1]
    assert two.calls == [1] * ct2.ThreadChoice.PROBES + [4] * ct2.ThreadChoice.PROBES
    choice.close()
    assert one.closed and two.closed


def test_one_thread_asked_makes_one_worker(monkeypatch, tmp_path):
    monkeypatch.setattr(ct2, "Worker", SlowOrFast)
    SlowOrFast.made = {}
    choice = ct2.ThreadChoice(tmp_path, "float32", threads=1)
    assert list(SlowOrFast.made) == [1]
    assert choice.translate([[5, 2]] * 2, 4, 2) == [[1, 1]] * 2
    assert choice.choices[2]["threads"] == 1
