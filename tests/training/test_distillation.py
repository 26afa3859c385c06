"""DeiT's hard distillation: the ViT's distillation token and head, the CNN teacher, the loss, the run folder and
the export of a distilled ViT (models/vit.py, models/convnet.py, models/tasks/vit.py, models.runs.train_teacher)."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from models.config import TEACHER_PRESETS, ConvNetConfig, TrainConfig, ViTConfig, get_preset
from models.convnet import ConvNet
from models.runs import TEACHER_DIR, train_teacher
from models.tasks.vit import ViTTask
from models.vit import ViT

SMALL = ViTConfig(patch_size=7, d_model=32, n_heads=4, n_layers=1, d_ff=64, dropout=0.0)


def _images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), rng.integers(0, 10, n)


def test_the_distillation_token_adds_one_position_and_its_head_is_averaged_in():
    torch.manual_seed(0)
    plain, distilled = ViT(SMALL).eval(), ViT(replace(SMALL, distillation=True)).eval()
    assert plain.pos_embed.shape[1] == 1 + 16 and distilled.pos_embed.shape[1] == 2 + 16
    assert plain.dist_token is None and plain.head_dist is None
    pixels = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        logits, dist = distilled.forward_heads(pixels)
        tokens = distilled.forward_features(pixels)
        torch.testing.assert_close(logits, distilled.head(tokens[:, 0]))
        torch.testing.assert_close(dist, distilled.head_dist(tokens[:, 1]))
        torch.testing.assert_close(distilled(pixels), (logits + dist) / 2)
        assert not torch.allclose(logits, dist)  # two heads on two tokens, not one head twice
        cls_only, none = plain.forward_heads(pixels)
        assert none is None and torch.equal(plain(pixels), cls_only)


def test_the_teacher_is_a_cnn_that_classifies_any_batch():
    teacher = ConvNet(ConvNetConfig(widths=(8, 16, 16))).eval()
    with torch.no_grad():
        assert teacher(torch.randn(5, 1, 28, 28)).shape == (5, 10)
    convs = [m for m in teacher.features if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [8, 8, 16, 16, 16, 16]


def test_the_hard_distillation_loss_weighs_true_and_teacher_labels_equally():
    torch.manual_seed(0)
    cfg = TrainConfig(batch_size=4, label_smoothing=0.1)
    teacher = ConvNet(ConvNetConfig(widths=(4, 8, 8)))
    student = ViT(replace(SMALL, distillation=True))
    task = ViTTask(student.config, cfg, _images(8), _images(4, seed=1), teacher=teacher)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    x, y = next(task.batches(0))
    loss, units = task.loss(student, (x, y))
    logits, dist = student.forward_heads(x)
    with torch.no_grad():
        taught = teacher(x).argmax(-1)
    expected = (F.cross_entropy(logits, y, label_smoothing=0.1) + F.cross_entropy(dist, taught)) / 2
    assert units == 4
    torch.testing.assert_close(loss, expected)
    # the teacher's labels, not the true ones, drive the distillation head: other labels, another loss
    wrong = (F.cross_entropy(logits, y, label_smoothing=0.1) + F.cross_entropy(dist, (taught + 1) % 10)) / 2
    assert not torch.isclose(loss, wrong)


def test_a_teacher_on_another_split_than_its_student_is_refused(tmp_path, data_dir):
    _, student_cfg = get_preset("vit", "tiny-distilled")
    with pytest.raises(ValueError, match="another split"):
        train_teacher(replace(student_cfg, validation_size=50), data_dir, tmp_path)


def test_every_teacher_preset_trains_on_its_students_split():
    for name in ("distilled", "tiny-distilled"):
        _, student_cfg = get_preset("vit", name)
        _, teacher_cfg = TEACHER_PRESETS[student_cfg.teacher]
        assert (teacher_cfg.train_limit, teacher_cfg.validation_size) == \
            (student_cfg.train_limit, student_cfg.validation_size)


@pytest.fixture(scope="module")
def distilled_run(tmp_path_factory, data_dir):
    from models.train import main

    out = tmp_path_factory.mktemp("distilled") / "vit-tiny-distilled"
    assert main(["vit", "--preset", "tiny-distilled", "--data-dir", str(data_dir), "--out", str(out), "--quiet"]) == 0
    return out


def test_a_distilled_run_trains_its_teacher_first_and_records_it(distilled_run, data_dir):
    metrics = json.loads((distilled_run / "metrics.json").read_text())
    teacher = metrics["teacher"]
    assert teacher["preset"] == "tiny" and teacher["val_images"] == 100 and 0 <= teacher["test_accuracy"] <= 100
    assert (distilled_run / TEACHER_DIR / "model.pt").is_file()
    # a second run reloads the finished teacher rather than training it again
    stamp = (distilled_run / TEACHER_DIR / "model.pt").stat().st_mtime_ns
    _, cfg = get_preset("vit", "tiny-distilled")
    model, again = train_teacher(cfg, data_dir, distilled_run, progress=False)
    assert again == json.loads((distilled_run / TEACHER_DIR / "metrics.json").read_text())
    assert (distilled_run / TEACHER_DIR / "model.pt").stat().st_mtime_ns == stamp and not model.training


def test_a_distilled_vit_exports_with_its_two_heads_averaged(distilled_run, data_dir, tmp_path):
    from export.__main__ import main as export_main

    assert export_main(["vit", "--checkpoint", str(distilled_run), "--repository", str(tmp_path),
                        "--data-dir", str(data_dir)]) == 0
    version = tmp_path / "vit" / "1"
    checks = json.loads((version / "metrics.json").read_text())["export_checks"]
    assert checks["onnx_test_accuracy_minus_pytorch"] == 0
    same, total = map(int, checks["argmax_identical"].split("/"))
    assert same == total
    assert json.loads((version / "config.json").read_text())["architecture"]["distillation_token"] is True
    assert "distilled from a CNN teacher" in (version / "README.md").read_text()
