"""Export: repository layout, config and model card, graph interfaces, versions and errors."""

import json

import onnx
import pytest

from export.__main__ import main as export_main
from service.engines import onnx_schema as schema
from service.repository import ModelRepository, RepositoryError

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind, files", [("translation", ["encoder.onnx", "decoder.onnx", "tokenizer.json"]),
                                         ("gpt", ["decoder.onnx", "tokenizer.json"]), ("vit", ["model.onnx"])])
def test_version_folder_is_complete(tiny_repository, kind, files):
    folder = tiny_repository / kind / "1"
    for name in files + ["config.json", "metrics.json", "README.md", "curves.png"]:
        assert (folder / name).is_file(), name
    config = json.loads((folder / "config.json").read_text())
    assert config["kind"] == kind and config["name"] == kind and config["version"] == 1
    metrics = json.loads((folder / "metrics.json").read_text())
    checks = metrics["export_checks"]
    assert all(v <= 1e-4 for k, v in checks.items() if k.endswith("diff"))
    # 50 validation prompts/sentences; the ViT: the first 1,000 test images, all 500 of the fixtures
    assert checks.get("greedy_identical", checks.get("argmax_identical")) in ("50/50", "500/500")
    card = (folder / "README.md").read_text()
    assert "python -m models.train" in card and "Export checks" in card and str(metrics["parameters"]) in \
        card.replace(",", "")


def test_card_records_the_exported_graphs_own_quality(tiny_repository):
    gpt = json.loads((tiny_repository / "gpt" / "1" / "metrics.json").read_text())
    assert abs(gpt["export_checks"]["onnx_val_loss"] - gpt["val_loss"]) <= 2e-4  # both rounded to 4 places
    assert gpt["export_checks"]["onnx_val_loss_minus_pytorch"] == pytest.approx(
        gpt["export_checks"]["onnx_val_loss"] - gpt["val_loss"], abs=1e-4)
    vit = json.loads((tiny_repository / "vit" / "1" / "metrics.json").read_text())
    assert vit["export_checks"]["onnx_test_accuracy"] == vit["test_accuracy"]
    assert vit["export_checks"]["onnx_test_accuracy_minus_pytorch"] == 0
    # the ViT's choices were made on a validation split held out of the training images, and the card says so
    assert vit["val_images"] == 100 and 0 <= vit["val_accuracy"] <= 100
    assert "held out as the validation split" in (tiny_repository / "vit" / "1" / "README.md").read_text()


def test_the_length_penalty_is_chosen_on_validation_and_served_by_default(tiny_repository):
    from models.evaluate import LENGTH_PENALTIES

    card = json.loads((tiny_repository / "translation" / "1" / "metrics.json").read_text())
    by_penalty = card["val_bleu_beam4_by_length_penalty"]
    assert [float(p) for p in by_penalty] == list(LENGTH_PENALTIES)
    chosen = card["length_penalty"]
    assert by_penalty[str(chosen)] == max(by_penalty.values()) == card["val_bleu"]
    assert chosen == next(p for p in LENGTH_PENALTIES if by_penalty[str(p)] == max(by_penalty.values()))
    config = json.loads((tiny_repository / "translation" / "1" / "config.json").read_text())
    assert config["generation"] == {"length_penalty": chosen}


def test_config_describes_the_models(tiny_repository):
    repo = ModelRepository(tiny_repository)
    translation = repo.get("translation").config
    assert translation["special_tokens"] == {"pad_id": 0, "bos_id": 1, "eos_id": 2}
    assert translation["architecture"]["head_dim"] * translation["architecture"]["n_heads"] == \
        translation["architecture"]["d_model"]
    gpt = repo.get("gpt").config
    assert gpt["context_length"] == 64 and gpt["special_tokens"]["eos_id"] == 256
    vit = repo.get("vit").config
    assert vit["image"]["size"] == 28 and vit["image"]["channels"] == 1 and len(vit["labels"]) == 10
    assert vit["labels"][9] == "Ankle boot"


def test_graph_interfaces_follow_the_shared_schema(tiny_repository):
    def names(path):
        graph = onnx.load(str(path)).graph
        return tuple(i.name for i in graph.input), tuple(o.name for o in graph.output)

    folder = tiny_repository / "translation" / "1"
    spec = schema.decoder_spec(2)
    assert names(folder / "decoder.onnx") == (spec.inputs, spec.outputs)
    assert "past_key_values.1.value" in spec.inputs and "present.1.value" in spec.outputs
    spec = schema.encoder_spec(2)
    assert names(folder / "encoder.onnx") == (spec.inputs, spec.outputs)
    spec = schema.gpt_decoder_spec(2)
    assert names(tiny_repository / "gpt" / "1" / "decoder.onnx") == (spec.inputs, spec.outputs)
    assert names(tiny_repository / "vit" / "1" / "model.onnx") == (("pixel_values",), ("logits",))


def test_versions_increment_and_the_highest_is_loaded(tiny_runs, data_dir, tmp_path):
    repo_root = tmp_path / "repo"
    args = ["vit", "--checkpoint", str(tiny_runs["vit"]), "--repository", str(repo_root), "--data-dir", str(data_dir)]
    assert export_main(args) == 0 and export_main(args) == 0
    assert export_main(args + ["--version", "7"]) == 0
    repo = ModelRepository(repo_root)
    assert repo.versions("vit") == [1, 2, 7]
    assert repo.get("vit").version == 7 and repo.get("vit", 2).version == 2
    assert export_main(args + ["--version", "2"]) == 2  # never overwrite a version
    assert not list((repo_root / "vit").glob(".*"))  # no staging folders left behind
    with pytest.raises(RepositoryError, match="no version 3"):
        repo.get("vit", 3)
    with pytest.raises(RepositoryError, match="not found"):
        repo.get("nope")


def test_wrong_kind_or_missing_run_is_a_clear_error(tiny_runs, tmp_path, capsys):
    assert export_main(["gpt", "--checkpoint", str(tiny_runs["vit"]), "--repository", str(tmp_path)]) == 2
    assert "holds a vit model" in capsys.readouterr().err
    assert export_main(["gpt", "--checkpoint", str(tmp_path / "none"), "--repository", str(tmp_path)]) == 2
    assert "not found" in capsys.readouterr().err


def test_fp16_weight_storage_halves_the_files_and_keeps_the_outputs(tiny_runs, tiny_repository, data_dir, tmp_path):
    assert export_main(["gpt", "--checkpoint", str(tiny_runs["gpt"]), "--repository", str(tmp_path),
                        "--data-dir", str(data_dir), "--weights", "fp16"]) == 0
    half, full = tmp_path / "gpt" / "1" / "decoder.onnx", tiny_repository / "gpt" / "1" / "decoder.onnx"
    assert half.stat().st_size < 0.6 * full.stat().st_size
    checks = json.loads((tmp_path / "gpt" / "1" / "metrics.json").read_text())["export_checks"]
    assert checks["fp16_weights_same_greedy_output_as_fp32"] == "50/50"
    assert abs(checks["onnx_val_loss_minus_pytorch"]) < 0.01  # float16 storage barely moves the loss

    assert export_main(["vit", "--checkpoint", str(tiny_runs["vit"]), "--repository", str(tmp_path),
                        "--data-dir", str(data_dir), "--weights", "fp16"]) == 0
    checks = json.loads((tmp_path / "vit" / "1" / "metrics.json").read_text())["export_checks"]
    same, total = map(int, checks["fp16_weights_same_argmax_as_fp32"].split("/"))
    assert total == 500 and same >= 495 and abs(checks["onnx_test_accuracy_minus_pytorch"]) <= 0.5
    assert "float16" in json.loads((tmp_path / "gpt" / "1" / "config.json").read_text())["weights_storage"]


def test_a_stem_vits_card_omits_the_patch_size_it_does_not_use(tmp_path):
    """The card's Architecture is the model config; a convolutional stem replaces the patch convolution, so the
    unused `patch_size` default would mislead (vit/4's card once listed `patch_size: 4` beside its stem)."""
    from dataclasses import asdict

    from export.repository import _model_card
    from models.config import ViTConfig

    def architecture(model: ViTConfig) -> dict:
        run_config = {"task": "vit", "preset": "release", "model": asdict(model), "train": {}}
        card = _model_card("vit", 1, {"kind": "vit"}, {}, run_config, tmp_path)
        return json.loads(card.split("## Architecture")[1].split("```json")[1].split("```")[0])

    stem = architecture(ViTConfig(stem_widths=(32, 64, 128)))
    assert "patch_size" not in stem and stem["stem_widths"] == [32, 64, 128]
    assert architecture(ViTConfig(patch_size=7))["patch_size"] == 7
