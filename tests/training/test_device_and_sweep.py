"""Training on a GPU (`python -m models.train --device`) and side-by-side runs (`python -m models.sweep`).

CI has no GPU: the device choice is checked as logic, the GPT task's batches are checked to follow the model onto
another device with PyTorch's `meta` device (shapes without storage), and the sweep runs the tiny preset on the CPU.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest
import torch

from models.config import GPTConfig, TrainConfig, get_preset
from models.gpt import GPT
from models.sweep import TIME_SAFETY, fitted_steps
from models.sweep import main as sweep
from models.tasks.gpt import GPTTask
from models.train import main as train_main
from models.train import training_device


def test_auto_picks_a_gpu_only_for_the_task_that_can_use_one():
    assert training_device("cpu", "gpt") == torch.device("cpu")
    for task in ("translation", "vit"):
        assert training_device("auto", task) == torch.device("cpu")
    assert training_device("auto", "gpt").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("requested, task, says", [
    ("cuda", "vit", "only gpt trains on a GPU"),
    ("cuda:0", "translation", "only gpt trains on a GPU"),
    ("tpu", "gpt", "choose auto, cpu, cuda or cuda:N"),
])
def test_a_device_that_cannot_be_used_is_refused_by_name(requested, task, says):
    with pytest.raises(ValueError, match=says):
        training_device(requested, task)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this PyTorch sees a GPU")
def test_asking_for_a_gpu_without_one_is_a_clear_error(tmp_path, capsys):
    assert train_main(["gpt", "--preset", "tiny", "--device", "cuda", "--out", str(tmp_path / "run")]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before any data or folder


def test_gpt_batches_follow_the_model_onto_its_device():
    """A model on another device gets its batches there (the `meta` device stands in for a GPU)."""
    config = GPTConfig(context_length=16, d_model=32, n_heads=4, n_layers=1, d_ff=64, dropout=0.0)
    ids = np.arange(400) % 200
    task = GPTTask(config, TrainConfig(batch_size=4), ids, ids)
    batch = next(iter(task.batches(0)))
    assert batch[0].device.type == "cpu"
    loss, units = task.loss(GPT(config).to("meta"), batch)
    assert loss.device.type == "meta" and units == 4 * 16


def test_steps_are_cut_only_where_the_budget_would_not_fit():
    assert fitted_steps(8000, 0.04, 1000.0) == 8000  # 340 s of steps fit in 850 s
    assert fitted_steps(8000, 0.04, 100.0) == int(100 * TIME_SAFETY / 0.04)
    assert fitted_steps(None, 0.5, 100.0) == int(100 * TIME_SAFETY / 0.5)
    with pytest.raises(SystemExit, match="time budget is spent"):
        fitted_steps(8000, 0.04, -5.0)


def test_a_sweep_trains_each_preset_and_ranks_them(tmp_path, data_dir, capsys):
    out = tmp_path / "sweep"
    assert sweep(["gpt", "--presets", "tiny", "--device", "cpu", "--threads", "1", "--data-dir", str(data_dir),
                  "--out", str(out)]) == 0
    rows = json.loads((out / "sweep.json").read_text())
    assert [row["preset"] for row in rows] == ["tiny"]
    metrics = json.loads((out / "tiny" / "metrics.json").read_text())
    assert rows[0]["metrics"] == metrics and rows[0]["exit_code"] == 0
    assert rows[0]["steps"] == metrics["steps"] == get_preset("gpt", "tiny")[1].max_steps
    assert metrics["train_device"] == "cpu" and (out / "tiny" / "model.pt").exists()
    assert f"{metrics['val_loss']}" in capsys.readouterr().out


def test_a_sweep_reports_runs_that_failed(tmp_path):
    out = tmp_path / "sweep"
    assert sweep(["gpt", "--presets", "tiny", "--device", "cpu", "--data-dir", str(tmp_path / "nowhere"),
                  "--out", str(out)]) == 1
    (row,) = json.loads((out / "sweep.json").read_text())
    assert row["exit_code"] == 2 and row["metrics"] is None
    assert "nowhere" in (out / "tiny" / "train.log").read_text()


def test_an_unknown_preset_is_refused_before_anything_runs(tmp_path, capsys):
    assert sweep(["gpt", "--presets", "tiny,nonesuch", "--out", str(tmp_path / "sweep")]) == 2
    assert "nonesuch" in capsys.readouterr().err and not (tmp_path / "sweep").exists()


def test_a_gpu_trained_models_card_says_where_it_trained(tmp_path):
    from export.repository import _model_card

    run_config = {"task": "gpt", "preset": "release", "model": asdict(GPTConfig()), "train": {}}
    on_gpu = _model_card("gpt", 1, {"kind": "gpt"}, {"train_device": "NVIDIA H200"}, run_config, tmp_path)
    assert "`python -m models.train gpt --preset release --device cuda`" in on_gpu
    assert "trained on: NVIDIA H200" in on_gpu
    on_cpu = _model_card("gpt", 1, {"kind": "gpt"}, {"train_device": "cpu"}, run_config, tmp_path)
    assert "`python -m models.train gpt --preset release`" in on_cpu and "trained on" not in on_cpu
