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
