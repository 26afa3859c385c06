"""bench/profile_gpt.py on real graphs, briefly: its timed split of a step and ONNX Runtime's node profile of the
steps (the prompt pass left out), with the outputs of the profiled pass equal to the timed ones."""

from __future__ import annotations

import re
import sys

import pytest

from tests.support import ROOT

BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import profile_gpt  # noqa: E402 - after the sys.path set-up, as the script's own


@pytest.mark.parametrize("where, variant", [("tiny", None), ("release", "int8+gqa")])
def test_the_profile_splits_the_steps_and_names_their_operators(where, variant, tiny_repository, capsys):
    repository = tiny_repository if where == "tiny" else ROOT / "model_repository"
    args = ["--repository", str(repository), "--batch", "2", "--new-tokens", "6", "--repeats", "1"]
    assert profile_gpt.main(args + (["--variant", variant] if variant else [])) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU: ")
    shares = re.search(r"ONNX Runtime [\d.]+ ms \((\d+)%\), searches [\d.]+ ms \((\d+)%\), the rest -?[\d.]+ ms "
                       r"\((-?\d+)%\)", out)
    assert shares and 98 <= sum(int(x) for x in shares.groups()) <= 102
    assert "5 steps" in out  # 6 new tokens: the first from the prompt pass, 5 steps
    operators = re.findall(r"^  (\w+) +[\d.]+ us +[\d.]+%$", out, re.MULTILINE)
    assert ("MatMulNBits" if variant else "MatMul") in operators
    if variant:
        assert "GroupQueryAttention" in operators
    assert re.search(r"^outputs [0-9a-f]{40}$", out, re.MULTILINE)  # no "differ" after the digest
