"""Graph variants of a version in the repository (`python -m export.convert`) and at export (`python -m export
--weights int8`): smaller files, the same interface, logits close to float32, the variant recorded in config.json
and the card, and nothing written when a quality check fails."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from PIL import Image

from export.__main__ import main as export_main
from export.convert import main as convert_main
from service.engines import onnx_schema as schema
from service.engines.gpt import GPTEngine
from service.engines.kv_cache import KVCache
from service.engines.vit import ViTEngine
from service.repository import ModelRepository

pytestmark = pytest.mark.slow

# |int8 logit - float32 logit| of the tiny models on the inputs below (GPT: 16 windows of 64 tokens of the fixture
# text, logits' std 2.5; ViT: 64 test images, std 1.7): measured largest 0.13 and 0.05, mean 0.008 and 0.010
# (MatMulNBits; ONNX Runtime's dynamic quantisation had given 0.37 and 0.19, mean 0.016 and 0.018).
INT8_LOGITS_MAX_DIFF = 0.5
INT8_LOGITS_MEAN_DIFF = 0.03
# int8 file / float32 file, tiny models: measured GPT 0.37, ViT 0.56 (its small matrices carry relatively more
# graph and quantisation parameters).
INT8_SIZE_RATIO = 0.8


def _copy(tiny_repository, tmp_path, *names: str):
    repository = tmp_path / "repository"
    for name in names:
        shutil.copytree(tiny_repository / name / "1", repository / name / "1")
    return repository


def _convert(repository, name: str, data_dir, *extra: str) -> int:
    return convert_main(["--repository", str(repository), "--name", name, "--from-version", "1", "--to-version", "2",
                         "--data-dir", str(data_dir), *extra])


def _interface(path) -> tuple:
    graph = onnx.load(str(path)).graph
    return [(i.name, i.type.tensor_type.elem_type) for i in graph.input], [o.name for o in graph.output]


@pytest.mark.parametrize("name", ["gpt", "translation", "vit"])
def test_int8_conversion_is_smaller_same_interface_and_recorded(tiny_repository, data_dir, tmp_path, capsys, name):
    repository = _copy(tiny_repository, tmp_path, name)
    assert _convert(repository, name, data_dir, "--weights", "int8") == 0
    source, converted = repository / name / "1", repository / name / "2"
    config = json.loads((converted / "config.json").read_text())
    assert (config["weights"], config["attention"], config["derived_from"], config["version"]) == ("int8", "plain",
                                                                                                   1, 2)
    for file in config["files"].values():
        assert (converted / file).stat().st_size < INT8_SIZE_RATIO * (source / file).stat().st_size
        assert _interface(converted / file) == _interface(source / file)
        assert any(node.op_type == "MatMulNBits" for node in onnx.load(str(converted / file)).graph.node)
    conversion = json.loads((converted / "metrics.json").read_text())["conversion"]
    quality = conversion["quality"]
    assert quality["reference"] == json.loads((source / "metrics.json").read_text())[quality["metric"]]
    assert quality["delta"] == pytest.approx(quality["measured"] - quality["reference"], abs=1e-4)
    same, total = map(int, conversion["same_as_source"].split("/"))
    assert total in (50, 500) and same >= 0.5 * total
    card = (converted / "README.md").read_text()
    assert "python -m export.convert" in card and "int8" in card and "Version 1's card" in card
    assert "python -m models.train" in card  # the source card, kept
    assert f"wrote {converted}" in capsys.readouterr().out
    assert ModelRepository(repository).get(name).version == 2  # the loader picks the new version


def test_int8_logits_stay_close_to_float32(tiny_repository, data_dir, tmp_path):
    from models.data import load_fashion_mnist

    repository = _copy(tiny_repository, tmp_path, "gpt", "vit")
    for name in ("gpt", "vit"):
        assert _convert(repository, name, data_dir, "--weights", "int8") == 0
    repo = ModelRepository(repository)
    fp32, int8 = GPTEngine(repo.get("gpt", 1)), GPTEngine(repo.get("gpt", 2))
    text = (data_dir / "tinyshakespeare" / "input.txt").read_text()[-2000:]
    ids = np.asarray(fp32.tokenizer.encode(text).ids[: 16 * 64], np.int64).reshape(16, 64)
    feeds = {schema.INPUT_IDS: ids, schema.POSITION_IDS: np.tile(np.arange(64), (16, 1)),
             schema.ATTENTION_MASK: np.ones_like(ids), **KVCache.empty(16, fp32.n_layers, fp32.n_heads,
                                                                       fp32.head_dim).feeds()}
    gpt_diff = np.abs(fp32.session.run(None, feeds)[0] - int8.session.run(None, feeds)[0])
    images, _ = load_fashion_mnist(data_dir, "test")
    fp32, int8 = ViTEngine(repo.get("vit", 1)), ViTEngine(repo.get("vit", 2))
    pixels = np.stack([fp32.preprocess(Image.fromarray(i)) for i in images[:64]])
    vit_diff = np.abs(fp32.logits(pixels) - int8.logits(pixels))
    for diff in (gpt_diff, vit_diff):
        assert 0 < diff.max() <= INT8_LOGITS_MAX_DIFF, diff.max()
        assert diff.mean() <= INT8_LOGITS_MEAN_DIFF, diff.mean()
    # every row's activations are quantised by themselves: a row alone and in a batch compute the same logits
    alone = np.concatenate([int8.logits(pixels[i : i + 1]) for i in range(8)])
    np.testing.assert_array_equal(alone, int8.logits(pixels)[:8])


def test_a_failed_quality_check_writes_nothing(tiny_repository, data_dir, tmp_path, capsys):
    repository = _copy(tiny_repository, tmp_path, "gpt")
    card_path = repository / "gpt" / "1" / "metrics.json"
    card = json.loads(card_path.read_text())
    card["val_loss"] -= 0.01  # a float32 figure 0.01 nats better than the graphs give: int8 cannot be within 0.002
    card_path.write_text(json.dumps(card))
    assert _convert(repository, "gpt", data_dir, "--weights", "int8") == 1
    assert "outside the tolerance" in capsys.readouterr().err
    assert sorted(p.name for p in (repository / "gpt").iterdir()) == ["1"]  # no version 2, no staging folder


def test_cli_errors_exit_2_and_write_nothing(tiny_repository, data_dir, tmp_path, capsys):
    repository = _copy(tiny_repository, tmp_path, "vit")
    assert _convert(repository, "vit", data_dir) == 2  # fp32 + plain: nothing to convert
    assert "nothing to convert" in capsys.readouterr().err
    assert convert_main(["--repository", str(repository), "--name", "vit", "--from-version", "3", "--to-version",
                         "4", "--weights", "int8"]) == 2
    assert "no version 3" in capsys.readouterr().err
    assert convert_main(["--repository", str(repository), "--name", "vit", "--from-version", "1", "--to-version",
                         "1", "--weights", "int8"]) == 2
    assert "already exists" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        _convert(repository, "vit", data_dir, "--weights", "int4")
    assert exit_.value.code == 2
    assert sorted(p.name for p in (repository / "vit").iterdir()) == ["1"]


def test_export_with_int8_weights_records_the_check(tiny_runs, data_dir, tmp_path):
    assert export_main(["gpt", "--checkpoint", str(tiny_runs["gpt"]), "--repository", str(tmp_path),
                        "--data-dir", str(data_dir), "--weights", "int8"]) == 0
    folder = tmp_path / "gpt" / "1"
    config = json.loads((folder / "config.json").read_text())
    assert (config["weights"], config["attention"]) == ("int8", "plain") and "int8" in config["weights_storage"]
    checks = json.loads((folder / "metrics.json").read_text())["export_checks"]
    assert checks["greedy_identical"] == "50/50"  # the float32 graph vs PyTorch, before quantisation
    same, total = map(int, checks["int8_weights_same_greedy_output_as_fp32"].split("/"))
    assert total == 50 and same >= 25
    assert "tolerance 0.002" in checks["val_loss_within_tolerance"]
    assert abs(checks["onnx_val_loss_minus_pytorch"]) <= 0.002
    assert "int8" in (folder / "README.md").read_text()


def test_a_translation_exported_into_a_variant_records_its_bleu_through_the_service(tiny_runs, data_dir, tmp_path):
    assert export_main(["translation", "--checkpoint", str(tiny_runs["translation"]), "--repository",
                        str(tmp_path), "--data-dir", str(data_dir), "--weights", "fp16", "--attention", "mha"]) == 0
    folder = tmp_path / "translation" / "1"
    metrics = json.loads((folder / "metrics.json").read_text())
    checks = metrics["export_checks"]
    assert checks["served_bleu_minus_pytorch"] == pytest.approx(checks["served_bleu"] - metrics["bleu"], abs=0.01)
    assert f"{checks['served_bleu']} vs {metrics['bleu']}" in checks["bleu_within_tolerance"]
    config = json.loads((folder / "config.json").read_text())
    assert config["generation"] == {"length_penalty": metrics["length_penalty"]}  # what the service decoded with


def test_mha_attention_with_int8_weights(tiny_repository, data_dir, tmp_path):
    repository = _copy(tiny_repository, tmp_path, "gpt")
    assert _convert(repository, "gpt", data_dir, "--attention", "mha", "--weights", "int8") == 0
    config = json.loads((repository / "gpt" / "2" / "config.json").read_text())
    assert (config["weights"], config["attention"]) == ("int8", "mha")
    graph = onnx.load(str(repository / "gpt" / "2" / "decoder.onnx")).graph
    assert sum(node.op_type == "MultiHeadAttention" for node in graph.node) == config["architecture"]["n_layers"]


@pytest.mark.parametrize("name", ["gpt", "translation"])
def test_an_inplace_kv_cache_conversion_adds_a_step_graph_and_changes_no_output(tiny_repository, data_dir, tmp_path,
                                                                                 name):
    repository = _copy(tiny_repository, tmp_path, name, "vit")
    assert _convert(repository, name, data_dir, "--attention", "mha", "--kv-cache", "inplace") == 0
    folder = repository / name / "2"
    config = json.loads((folder / "config.json").read_text())
    assert (config["attention"], config["kv_cache"]) == ("mha", "inplace")
    assert config["files"]["decoder_step"] == schema.DECODER_STEP_FILE and (folder / schema.DECODER_STEP_FILE).exists()
    # the translator's decoder only ever takes one token per row: the step graph replaces it; the GPT's prompt pass
    # keeps its decoder
    assert ("decoder" in config["files"]) is (folder / schema.DECODER_FILE).exists() is (name == "gpt")
    source = json.loads((repository / name / "1" / "config.json").read_text())
    assert "decoder_step" not in source["files"]  # the source version is left as it was
    conversion = json.loads((folder / "metrics.json").read_text())["conversion"]
    assert conversion["same_as_source"] == "50/50" and conversion["kv_cache"] == "inplace"
    assert "in place" in (folder / "README.md").read_text()
    assert _convert(repository, "vit", data_dir, "--kv-cache", "inplace") == 2  # no decoder to step: refused


# --- the weights variants the service may choose (export.variants, service.models.variants) ---------------------

def test_every_export_checks_the_other_weights_variants_and_offers_them_only_when_they_passed(tiny_repository):
    for kind in ("translation", "gpt", "vit"):
        folder = tiny_repository / kind / "1"
        config = json.loads((folder / "config.json").read_text())
        checks = json.loads((folder / "metrics.json").read_text())["export_checks"]
        offered = config.get("variants", {})
        assert set(offered) <= {"int8", "int8rows"}, (kind, offered)  # no step graph to rewrite: no +gqa
        for weights in ("int8", "int8rows"):
            result = checks[f"{weights}_weights_variant"]
            assert result.startswith(f"{weights} (derived from fp32"), result
            assert (weights in offered) == ("not offered" not in result), (kind, result)
            if weights in offered:
                check = offered[weights]
                assert check["derived_from"] == "fp32" and check["reference"] == json.loads(
                    (folder / "metrics.json").read_text())[check["metric"]]
                assert check["delta"] <= check["tolerance"] if check["metric"] == "val_loss" else \
                    abs(check["delta"]) <= check["tolerance"]
        assert "## Weights variants" in (folder / "README.md").read_text()


def test_checking_some_variants_keeps_the_others_results(tiny_repository, data_dir, tmp_path, capsys):
    from export.variants import main as variants_main

    repository = _copy(tiny_repository, tmp_path, "vit")
    folder = repository / "vit" / "1"
    before = json.loads((folder / "config.json").read_text())["variants"]
    before_checks = json.loads((folder / "metrics.json").read_text())["export_checks"]
    assert variants_main(["--repository", str(repository), "--name", "vit", "--data-dir", str(data_dir),
                          "--variants", "int8rows"]) == 0
    assert capsys.readouterr().out.startswith("int8rows (derived from fp32")
    after = json.loads((folder / "config.json").read_text())["variants"]
    assert {k: v for k, v in after.items() if k != "int8rows"} == {k: v for k, v in before.items() if k != "int8rows"}
    checks = json.loads((folder / "metrics.json").read_text())["export_checks"]
    assert checks["int8_weights_variant"] == before_checks["int8_weights_variant"]
    card = (folder / "README.md").read_text()
    assert card.count("## Weights variants") == 1 and card.count("- int8 (derived") == 1
    assert card.count("- int8rows (derived") == 1
    assert variants_main(["--repository", str(repository), "--name", "vit", "--variants", "int8+gqa"]) == 2
    assert "int8+gqa" in capsys.readouterr().err


def test_a_variant_outside_the_tolerance_is_recorded_and_not_offered(tiny_repository, data_dir, tmp_path, capsys):
    from export.variants import main as variants_main

    repository = _copy(tiny_repository, tmp_path, "gpt")
    card_path = repository / "gpt" / "1" / "metrics.json"
    card = json.loads(card_path.read_text())
    card["val_loss"] = round(card["val_loss"] - 0.5, 4)  # a card figure no variant of these weights reaches
    card_path.write_text(json.dumps(card))
    assert variants_main(["--repository", str(repository), "--name", "gpt", "--data-dir", str(data_dir)]) == 0
    assert "int8 (derived from fp32): not offered" in capsys.readouterr().out
    config = json.loads((repository / "gpt" / "1" / "config.json").read_text())
    assert config["variants"] == {}
    recorded = json.loads(card_path.read_text())["export_checks"]["int8_weights_variant"]
    assert "not offered" in recorded and "outside the tolerance" in recorded
    card_text = (repository / "gpt" / "1" / "README.md").read_text()
    assert card_text.count("## Weights variants") == 1 and "not offered" in card_text
    assert ModelRepository(repository).get("gpt", 1).config["variants"] == {}
