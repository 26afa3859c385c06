"""bench/calibration_length.py on the served GPT, briefly: every variant and batch size gets its phases timed."""

from __future__ import annotations

import re
import sys

import pytest

from tests.support import ROOT

BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import calibration_length  # noqa: E402 - after the sys.path set-up, as the script's own


def test_each_variant_and_batch_size_is_split_into_its_phases(capsys):
    args = ["--variants", "int8,int8+gqa", "--rows", "1,3", "--steps", "20", "--rounds", "1"]
    assert calibration_length.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and "20 steps, 1 rounds" in out
    lines = re.findall(r"^ *(\S+) rows +(\d+): (.*)$", out, re.MULTILINE)
    assert [(variant, rows) for variant, rows, _ in lines] == [("int8", "1"), ("int8+gqa", "1"), ("int8", "3"),
                                                                ("int8+gqa", "3")]
    for _, _, fields in lines:
        timings = dict(re.findall(r"(\w+) ([\d.]+)", fields))
        assert list(timings) == ["prefill_ms", "first_step_ms", "steps_2_16_ms", "steps_17_20_ms",
                                 "per_token_16_ms", "per_token_20_ms"]
        assert all(float(value) > 0 for value in timings.values())


def test_a_request_no_longer_than_the_short_workload_is_refused():
    with pytest.raises(SystemExit) as exit_:
        calibration_length.main(["--steps", "16"])
    assert exit_.value.code == 2
