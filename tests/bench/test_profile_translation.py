"""bench/profile_translation.py on the release translator, briefly: the weights variant it is asked for (the int8
graph's MatMulNBits in ONNX Runtime's node profile, float32 MatMul otherwise), its timed share outside ONNX Runtime,
and the operator table of `--operators`."""

from __future__ import annotations

import re
import sys

import pytest

from tests.support import ROOT

BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import profile_translation  # noqa: E402 - after the sys.path set-up, as the script's own


@pytest.mark.parametrize(("variant", "operator"), [("int8", "MatMulNBits"), ("fp32", "MatMul")])
def test_the_profile_runs_the_variant_asked_and_names_its_operators(variant, operator, capsys):
    args = ["--repository", str(ROOT / "model_repository"), "--data-dir", str(ROOT / "tests" / "fixtures" / "data"),
            "--batch", "2", "--sentences", "2", "--repeats", "1", "--variant", variant, "--operators"]
    assert profile_translation.main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("CPU: ") and f"variant {variant}" in out
    assert re.search(r"outside it [\d.]+% \(passes: [\d.]+\)", out)
    operators = re.findall(r"^  (\w+) +[\d.]+ ms +[\d.]+%$", out, re.MULTILINE)
    assert operator in operators and (operator != "MatMul" or "MatMulNBits" not in operators)
    assert re.search(r"^outputs [0-9a-f]{40}$", out, re.MULTILINE)
