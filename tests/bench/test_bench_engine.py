"""bench/bench_engine.py's harness without a benchmark: its command line, and bench/enginebench's timing, checks,
summary and printing driven by fake systems (numpy only: no model is built, nothing is timed for real)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tests.support import ROOT

BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_engine  # noqa: E402 - after the sys.path set-up, as the script's own
from enginebench.measure import measure, summarise  # noqa: E402
from enginebench.report import print_result, print_table  # noqa: E402
from spread import ratio_spread  # noqa: E402
from enginebench.systems import BUILDERS, SYSTEMS  # noqa: E402
from enginebench.workloads import GptSpec, make_prompts  # noqa: E402


def fake_system(new_tokens: int, token: int):
    def generate(prompts: np.ndarray) -> np.ndarray:
        return np.full((prompts.shape[0], new_tokens), token, np.int64)

    return generate


def test_every_system_of_a_task_is_a_known_system_and_the_tasks_are_the_cli_choices():
    assert set(BUILDERS) | {"scaling", "prefix"} == set(bench_engine.TASKS)
    assert all(set(builders) <= set(SYSTEMS) for builders in BUILDERS.values())


@pytest.mark.parametrize("option", ["--systems=nope", "--tasks=nope"])
def test_unknown_system_or_task_is_a_usage_error(option):
    with pytest.raises(SystemExit) as exit_info:
        bench_engine.main([option])
    assert exit_info.value.code == 2


def test_measure_summarise_and_print_a_case(capsys):
    spec = GptSpec(new_tokens=4)
    prompts = make_prompts(spec, 3)
    assert prompts.shape == (3, spec.prompt_tokens) and prompts.min() >= 3
    systems = {"transformers": fake_system(4, 7), "optimum": fake_system(4, 7), "ours": fake_system(4, 7)}
    times, outputs = measure(systems, [prompts], spec.new_tokens, warmup=1, repeats=3)
    assert {name: len(seconds) for name, seconds in times.items()} == dict.fromkeys(systems, 3)
    result = summarise("gpt greedy batch 3", "tokens/s", 3 * 4, times, outputs, {"genai": "ImportError: x"})
    assert result["transformers_optimum_agreement"] == 1.0
    assert result["ratios"]["ours/genai"] is None and result["ratios"]["ours/optimum"] > 0
    print_result(result)
    print_table([result])
    out = capsys.readouterr().out
    assert "genai" in out and "skipped" in out and "identical outputs transformers vs optimum: 100%" in out


def test_every_ratio_comes_with_its_rounds_spread_and_a_flag_when_they_disagree(capsys):
    # ours: 1 s a pass each round; ctranslate2: 2 s, then 1 s in the round it misbehaved (2x apart: flagged)
    times = {"ours": [1.0, 1.0, 1.0], "ctranslate2": [2.0, 1.0, 2.0], "genai": [1.1, 1.2, 1.1]}
    outputs = {}
    result = summarise("translation beam 4 batch 16", "sentences/s", 16, times, outputs, {})
    spread = result["ratio_spread"]
    assert spread["ours/ctranslate2"] == {"median": 2.0, "min": 1.0, "max": 2.0, "rounds": 3, "flagged": True}
    assert spread["ours/genai"]["flagged"] is False and spread["ours/genai"]["max"] == pytest.approx(1.2)
    assert set(spread) == {key for key, value in result["ratios"].items() if value is not None}
    assert ratio_spread([1.0], []) is None
    assert ratio_spread([1.3, 1.0], [1.0, 1.0])["flagged"] is False  # 1.3x apart: the margin itself is not flagged
    print_result(result)
    out = capsys.readouterr().out
    assert "ours/ctranslate2: rounds 1.00-2.00, median 2.00 of 3   FLAGGED: rounds disagree by more than 1.3x" in out
    assert "ours/genai: rounds 1.10-1.20, median 1.10 of 3\n" in out


def test_llama_cpp_q8_0_is_a_peer_of_shipped_with_the_issues_goals(capsys):
    """shipped against llama.cpp in its f32 (goal >= 1.3) and in its int8 q8_0 (goal >= 1.0), each with its spread,
    on the case's line and in the table."""
    times = {"shipped": [1.0, 1.0, 1.0], "llama.cpp": [1.4, 1.2, 1.4], "llama.cpp-q8_0": [0.9, 0.95, 0.9]}
    result = summarise("gpt greedy batch 16", "tokens/s", 16 * 4, times, {}, {})
    result["batch"] = 16
    assert result["ratios"]["shipped/llama.cpp-q8_0"] == pytest.approx(0.9)
    assert result["ratio_spread"]["shipped/llama.cpp-q8_0"] == pytest.approx(
        {"median": 0.9, "min": 0.9, "max": 0.95, "rounds": 3, "flagged": False})
    assert result["goals"] == {"shipped/llama.cpp": {"goal": ">= 1.3", "status": "PASS"},
                               "shipped/llama.cpp-q8_0": {"goal": ">= 1", "status": "MISS"}}
    print_result(result)
    print_table([result])
    out = capsys.readouterr().out
    assert "    shipped/llama.cpp b16 = 1.40   (issue 56 goal >= 1.3: PASS)\n" in out
    assert "    shipped/llama.cpp-q8_0 b16 = 0.90   (issue 56 goal >= 1: MISS)\n" in out
    assert "shipped/llama.cpp-q8_0: rounds 0.90-0.95, median 0.90 of 3\n" in out
    assert "shipped/llama q8_0" in out and "llama.cpp-q8_0" in SYSTEMS and "llama.cpp-q8_0" in BUILDERS["gpt"]


def test_measure_samples_the_machine_load_before_and_after_its_rounds():
    prompts = make_prompts(GptSpec(new_tokens=4), 2)
    times, outputs = measure({"ours": fake_system(4, 7)}, [prompts], 4, warmup=1, repeats=2)
    result = summarise("gpt greedy batch 2", "tokens/s", 8, times, outputs, {})
    before, after = result["load_before_after"]
    assert before >= 0 and after >= 0


def test_a_system_that_generates_a_different_number_of_tokens_is_an_error():
    prompts = make_prompts(GptSpec(), 2)
    with pytest.raises(RuntimeError, match="exactly the same number of tokens"):
        measure({"ours": fake_system(3, 5)}, [prompts], 4, warmup=1, repeats=1)


def test_ours_runs_each_model_as_the_service_does_without_the_web_stack():
    """ours/shipped take each kind's one-thread default (`DEFAULT_SINGLE_THREAD_ROWS`) unless --single-thread-rows
    sets one, and building their options imports nothing of the web stack: the bench venv has no prometheus_client
    or fastapi (a run once skipped both systems for that)."""
    import subprocess

    code = ("import sys; sys.path[:0] = ['bench', '.']\n"
            "from enginebench.ours import _ours_runtime_options\n"
            "from enginebench.workloads import Runtime\n"
            "rows = [_ours_runtime_options(Runtime(single_thread_rows=r), k).single_thread_rows\n"
            "        for r in (None, 0, 3) for k in ('gpt', 'translation')]\n"
            "heavy = sorted(m for m in ('prometheus_client', 'fastapi', 'starlette') if m in sys.modules)\n"
            "print(rows, heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[1, 0, 0, 0, 3, 3] []"


def test_a_system_that_cannot_run_a_case_is_skipped_in_it_with_its_reason():
    """ONNX Runtime GenAI refuses batches above 32: the case goes on without it, and says why."""
    def refuses(prompts: np.ndarray) -> np.ndarray:
        raise RuntimeError("batch_size (64) must be in [1, 32]")

    prompts = make_prompts(GptSpec(), 2)
    skipped: dict[str, str] = {}
    times, outputs = measure({"genai": refuses, "ours": fake_system(4, 7)}, [prompts], 4, 0, 2, skipped)
    assert set(times) == set(outputs) == {"ours"} and len(times["ours"]) == 2
    assert skipped == {"genai": "RuntimeError: batch_size (64) must be in [1, 32]"}
    with pytest.raises(RuntimeError, match="must be in"):  # without a place for the reason, the error stands
        measure({"genai": refuses}, [prompts], 4, 0, 1)


@pytest.mark.parametrize(("pins", "expected"), [
    (None, {"gpt": None, "translation": None}),
    ("int8", {"gpt": "int8", "translation": "int8"}),
    ("gpt=int8+gqa,translation=int8,vit=fp32", {"gpt": "int8+gqa", "translation": "int8"}),
    ("gpt=stored", {"gpt": None, "translation": None}),  # and a model it names nothing for: as stored
])
def test_shipped_runs_the_variant_pinned_for_its_model(pins, expected):
    from enginebench.ours import _runs_as
    from enginebench.workloads import Runtime

    runtime = Runtime(shipped_variant=pins)
    assert {model: _runs_as(runtime, model) for model in expected} == expected


def test_a_bad_shipped_variant_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_engine.main(["--shipped-variant", "gpt=fastest", "--tasks", "gpt", "--systems", "ours"])
    assert exit_info.value.code == 2 and "bad TSERVE_VARIANT entry" in capsys.readouterr().err


def test_the_served_variants_come_from_the_services_calibration(tmp_path, monkeypatch):
    """`--shipped-variant auto` asks the service's own venv (`calibrate --pins`) what this host is served; without
    that venv, or when the calibration fails, the stored variants, and why."""
    import shipped

    monkeypatch.setattr(shipped, "SERVICE_PYTHON", tmp_path / "missing" / "python")
    assert shipped.served_variants()[0] is None and "no service venv" in shipped.served_variants()[1]
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho \"$@\" >&2\necho 'gpt=int8+gqa,translation=int8'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(shipped, "SERVICE_PYTHON", fake)
    assert shipped.served_variants() == ("gpt=int8+gqa,translation=int8",
                                         "the service's calibration on this host (python -m service.models.calibrate "
                                         "--pins)")
    fake.write_text("#!/bin/sh\necho 'error: model not found' >&2\nexit 2\n")
    pins, why = shipped.served_variants()
    assert pins is None and "model not found" in why
