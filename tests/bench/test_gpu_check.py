"""bench/gpu_check.py without a GPU and without a benchmark: the wheel folder (a split wheel put back together, a
missing part, a hash the lock does not list), what `make gpu-wheels` asks pip for, the report's schema and text,
and a dry run whose CUDA steps are skipped by name (GPUs hidden, so it is a dry run on any machine)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT

BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from gpu import report, wheels  # noqa: E402 - after the sys.path set-up, as the script's own
from gpu.steps import (  # noqa: E402
    FAILED,
    PASSED,
    SKIPPED,
    STEPS,
    TIMEOUTS_S,
    TOTAL_BUDGET_S,
    Context,
    Step,
    wheels_step,
)

WHEEL = "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl"
PART_BYTES = 1000  # small parts of a small fake wheel: the same code path as split -b 18M
WHEEL_BYTES = 3 * PART_BYTES + 123  # four parts, the last one short


def lock_for(path, digest: str):
    """A lock in uv's format pinning onnxruntime-gpu==1.31.1 with `digest` (and one other hash)."""
    path.write_text(f"onnxruntime-gpu==1.31.1 \\\n    --hash=sha256:{'0' * 64} \\\n    --hash=sha256:{digest}\n"
                    "    # via transformer-serving (pyproject.toml)\n")
    return path


@pytest.fixture
def split_folder(tmp_path):
    """(folder holding WHEEL's parts, the wheel's bytes, a lock listing its sha256)."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    payload = os.urandom(WHEEL_BYTES)
    (folder / WHEEL).write_bytes(payload)
    parts = wheels.split_wheel(folder / WHEEL, PART_BYTES)
    assert [p.name.rsplit("-", 1)[1] for p in parts] == ["aa", "ab", "ac", "ad"]
    assert not (folder / WHEEL).exists()
    return folder, payload, lock_for(tmp_path / "lock.txt", hashlib.sha256(payload).hexdigest())


def test_split_parts_are_put_back_together_and_pass_the_lock(split_folder):
    folder, payload, lock = split_folder
    checked = wheels.check_folder(folder, locks=(lock,))
    assert (folder / WHEEL).read_bytes() == payload
    assert checked == {"wheels": {WHEEL: hashlib.sha256(payload).hexdigest()}, "assembled": {WHEEL: 4}}


def test_a_missing_part_is_named(split_folder):
    folder, _, lock = split_folder
    (folder / f"{WHEEL}.part-ab").unlink()
    with pytest.raises(wheels.WheelError, match=r"not consecutive, \.part-ab is missing"):
        wheels.check_folder(folder, locks=(lock,))
    assert not (folder / WHEEL).exists()


def test_a_missing_last_part_fails_the_hash_and_a_short_middle_one_its_size(split_folder):
    folder, payload, lock = split_folder
    (folder / f"{WHEEL}.part-ad").unlink()
    with pytest.raises(wheels.WheelError, match="is not the lock's"):
        wheels.check_folder(folder, locks=(lock,))
    (folder / f"{WHEEL}.part-ab").write_bytes(payload[PART_BYTES : PART_BYTES + 10])
    with pytest.raises(wheels.WheelError, match="unequal sizes"):
        wheels.check_folder(folder, locks=(lock,))


def test_a_wrong_hash_is_refused_naming_both(split_folder, tmp_path):
    folder, payload, _ = split_folder
    wrong = lock_for(tmp_path / "wrong.txt", "f" * 64)
    with pytest.raises(wheels.WheelError) as refused:
        wheels.check_folder(folder, locks=(wrong,))
    message = str(refused.value)
    assert hashlib.sha256(payload).hexdigest() in message and "f" * 64 in message
    assert "onnxruntime-gpu==1.31.1" in message


def test_the_wheels_step_fails_on_a_wrong_hash_and_skips_without_a_folder(split_folder, tmp_path, monkeypatch):
    folder, _, _ = split_folder
    monkeypatch.setattr(wheels, "LOCKS", (lock_for(tmp_path / "wrong.txt", "f" * 64),))
    step = Step("wheels")
    wheels_step(Context(wheels=folder, venv=tmp_path / "venv", out=tmp_path / "out"), step)
    assert step.status == FAILED and "is not the lock's" in step.reason
    step = Step("wheels")
    wheels_step(Context(wheels=tmp_path / "absent", venv=tmp_path / "venv", out=tmp_path / "out"), step)
    assert step.status == SKIPPED and step.reason.startswith(f"no wheel folder at {tmp_path / 'absent'}")


def test_the_locks_pin_onnxruntime_gpu_and_the_folder_leaves_out_what_the_image_has():
    version, hashes = wheels.parse_lock(wheels.SERVING_LOCK)["onnxruntime-gpu"]
    assert version == "1.31.1" and len(hashes) > 1 and all(len(h) == 64 for h in hashes)
    names = {line.split("==")[0] for line in wheels.wanted()}
    assert {"onnxruntime-gpu", "fastapi", "uvicorn", "tokenizers", "pytest", "httpx", "onnx"} <= names
    assert "numpy" not in names and not any(name.startswith("nvidia-") for name in names)
    assert all("--hash=sha256:" in line for line in wheels.wanted())


def test_the_step_timeouts_fit_the_budget():
    assert set(TIMEOUTS_S) == set(STEPS)
    assert sum(TIMEOUTS_S.values()) <= TOTAL_BUDGET_S


def fake_steps(cuda: bool) -> dict[str, Step]:
    steps = {name: Step(name, PASSED, "ok", 1.0, TIMEOUTS_S[name]) for name in STEPS}
    steps["bench-engine-cpu"].details = {"cases": {"gpt greedy batch 64": {"unit": "tokens/s", "throughput": 100.0}}}
    if cuda:
        steps["bench-engine-cuda"].details = {"cases": {"gpt greedy batch 64": {"unit": "tokens/s",
                                                                                "throughput": 2500.0}}}
    else:
        steps["bench-engine-cuda"] = Step("bench-engine-cuda", SKIPPED, "needs CUDA in use: no GPU")
    return steps


def test_the_report_has_its_schema_and_the_ratios():
    probe = {"gpu": {"present": True, "gpus": [{"name": "NVIDIA H100 80GB HBM3", "driver_version": "580.65",
                                                "memory.total": "81559 MiB"}]},
             "cpu": {"model": "AMD EPYC", "isa": ["avx2"]}, "python": "3.12.3", "cuda_in_use": True,
             "onnxruntime": {"version": "1.31.1", "providers": ["CUDAExecutionProvider", "CPUExecutionProvider"],
                             "distributions": {"onnxruntime-gpu": "1.31.1"}}}
    built = report.build(fake_steps(cuda=True), probe, "python bench/gpu_check.py")
    assert tuple(built) == report.REPORT_KEYS and built["schema"] == report.SCHEMA and built["ok"]
    assert [tuple(step) for step in built["steps"]] == [report.STEP_KEYS] * len(STEPS)
    assert built["ratios"]["gpt greedy batch 64"]["cuda/cpu"] == pytest.approx(25.0)
    text = report.render(json.loads(json.dumps(built)))  # as read back from the JSON
    assert "GPU: NVIDIA H100 80GB HBM3, driver 580.65, 81559 MiB" in text and "CPU: AMD EPYC" in text
    assert "cuda/cpu 25.00" in text


def test_the_report_without_a_gpu_records_it_absent_and_no_ratio(tmp_path):
    steps = fake_steps(cuda=False)
    steps["bench-http"] = Step("bench-http", FAILED, "3 errors")
    built = report.build(steps, {"gpu": {"present": False, "why": "nvidia-smi not found on PATH"}}, "x")
    assert not built["ok"] and built["host"]["gpu"] == {"present": False, "why": "nvidia-smi not found on PATH"}
    assert built["ratios"]["gpt greedy batch 64"]["cuda/cpu"] is None
    as_json, as_text = report.write(built, tmp_path)
    assert json.loads(as_json.read_text()) == built
    assert "GPU: absent (nvidia-smi not found on PATH)" in as_text.read_text()


@pytest.mark.slow
def test_a_dry_run_skips_the_cuda_steps_by_name_and_passes(tmp_path):
    """The script itself, its GPUs hidden, the benchmarks left out (`--steps`): the GPU tests run and skip."""
    steps = "wheels,install,environment,gpu-tests,bench-engine-cuda,bench-http"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "GPU_WHEELS": str(tmp_path / "no-wheels")}
    env.pop("TSERVE_REQUIRE_TOOLS", None)
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--steps", steps, "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    built = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {step["name"]: (step["status"], step["reason"]) for step in built["steps"]}
    assert status["wheels"] == (SKIPPED, f"no wheel folder at {tmp_path / 'no-wheels'} (`make gpu-wheels` "
                                         "prepares one)")
    assert status["install"][0] == SKIPPED and "wheels: skipped" in status["install"][1]
    assert status["environment"][0] == PASSED
    assert status["gpu-tests"][0] == SKIPPED
    assert status["gpu-tests"][1].startswith("every GPU test skipped: needs a CUDA GPU: ")
    for name in ("bench-engine-cuda", "bench-http"):
        assert status[name][0] == SKIPPED and status[name][1].startswith("needs CUDA in use: ")
    assert status["bench-engine-cpu"] == (SKIPPED, "not asked for (--steps)")
    assert not built["cuda_in_use"] and built["ok"]
    assert (tmp_path / "gpu_check.txt").read_text().startswith("gpu-check ")
