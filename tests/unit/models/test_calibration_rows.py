"""The batch sizes `auto` times the variants at (TSERVE_CALIBRATE_FOR): one row and the largest batch for a server,
the largest only for an offline batch job (`python -m service.batch` sets it: a job keeps its batches full)."""

from __future__ import annotations

import argparse

from service.batch.__main__ import job_settings
from service.models.kinds import KIND_TABLE
from service.models.registry import calibration_rows
from service.settings import Settings


def test_a_server_times_one_row_and_the_largest_batch_and_a_batch_job_the_largest_only():
    server = Settings(gpt_max_batch_rows=48, vit_max_batch_size=32)
    job = job_settings(server, argparse.Namespace(text=False, options={}))
    assert (server.calibrate_for, job.calibrate_for) == ("latency-and-throughput", "throughput")
    assert calibration_rows(server, KIND_TABLE["gpt"]) == [1, 48] and calibration_rows(job, KIND_TABLE["gpt"]) == [48]
    assert calibration_rows(job, KIND_TABLE["vit"]) == [32]
    assert calibration_rows(Settings(gpt_max_batch_rows=1), KIND_TABLE["gpt"]) == [1]


def test_candidates_are_timed_beside_the_reference_one_at_a_time_and_the_reference_by_its_median():
    """`measure_against`: each candidate built, timed beside the reference, and gone before the next is built (at
    most two engines alive); a candidate that cannot build is left out; the reference's time is its median."""
    import weakref

    from service.models import calibration

    alive: list = []
    beside = [3.0, 1.0, 2.0]  # the stored engine's item time beside a, b and c

    class Engine:
        def __init__(self, name: str):
            self.name = name
            alive.append(weakref.ref(self))

    stored = Engine("stored")
    pairs = iter([0, 1, 2])

    def build(name: str):
        if name == "broken":
            return None
        assert sum(ref() is not None for ref in alive) <= 2, "a candidate outlived its pair"
        return Engine(name)

    def fake_measure(engines, workload, rows, rounds, cold=None):
        times = {"stored": beside[next(pairs)], "a": 5.0, "b": 7.0, "c": 4.0}
        return {name: {size: times[name] for size in rows} for name in engines}

    original = calibration.measure
    calibration.measure = fake_measure
    try:
        timings = calibration.measure_against("stored", stored, ["a", "broken", "b", "c"], build, None, [1, 8])
    finally:
        calibration.measure = original
    assert timings == {"stored": {1: 2.0, 8: 2.0}, "a": {1: 5.0, 8: 5.0}, "b": {1: 7.0, 8: 7.0},
                       "c": {1: 4.0, 8: 4.0}}
    assert sum(ref() is not None for ref in alive) == 1  # the reference only
