"""The committed model repository: one release version per kind, quality targets met, within the size budget,
and served as committed (no training, no download) with outputs a user would accept."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from PIL import Image

from service.repository import ModelRepository
from service.settings import Settings

REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
KINDS = ("translation", "gpt", "vit")


def _version_dir(kind: str) -> Path:
    (version,) = ModelRepository(REPOSITORY).versions(kind)  # exactly one committed version
    return REPOSITORY / kind / str(version)


def _card(kind: str) -> dict:
    return json.loads((_version_dir(kind) / "metrics.json").read_text())


def test_release_targets_are_met_and_recorded():
    translation, gpt, vit = (_card(kind) for kind in KINDS)
    assert translation["preset"] == gpt["preset"] == vit["preset"] == "release"
    assert translation["bleu"] >= 35 and translation["test_2016_flickr_sentences"] == 1000
    assert gpt["val_loss"] <= 1.55 and gpt["val_tokens"] == 111_540  # the whole last 10% of tinyshakespeare
    assert vit["test_accuracy"] >= 92 and vit["test_images"] == 10_000
    assert vit["export_checks"]["onnx_test_accuracy"] >= 92  # the exported graph with float16 weights, too


def test_release_artifacts_fit_the_budget():
    size = sum(path.stat().st_size for kind in KINDS for path in (REPOSITORY / kind).rglob("*") if path.is_file())
    assert size <= 40 * 2**20, f"{size / 2**20:.1f} MB"


def test_the_committed_models_serve_real_answers(serving, data_dir):
    from models.data import load_fashion_mnist

    settings = Settings(repository=REPOSITORY, intra_op_threads=2)
    with serving(settings) as client:
        models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}  # OpenAI's list, with `ready`
        assert sorted(models) == sorted(KINDS) and all(m["ready"] for m in models.values())

        answer = client.post("/v1/translate", json={"text": "Zwei Hunde spielen im Schnee.", "num_beams": 4})
        assert answer.json()["translations"][0][0]["text"] == "Two dogs are playing in the snow."

        text = client.post("/v1/generate", json={"prompt": "ROMEO:\n", "max_new_tokens": 120,
                                                 "temperature": 0}).json()["text"]
        words = text.split()
        assert len(words) >= 15 and sum(w.strip(".,;:!?'").isalpha() for w in words) >= 0.8 * len(words)

        images, labels = load_fashion_mnist(data_dir, "test")
        files = []
        for i in range(32):
            buffer = io.BytesIO()
            Image.fromarray(images[i]).save(buffer, format="PNG")
            files.append(("files", (f"{i}.png", buffer.getvalue(), "image/png")))
        predictions = client.post("/v1/classify", files=files, data={"top_k": "1"}).json()["predictions"]
        correct = sum(p[0]["index"] == int(y) for p, y in zip(predictions, labels[:32]))
        assert correct >= 29  # measured: 30 of the first 32 test images (92.15% over all 10,000)


@pytest.mark.parametrize("kind", KINDS)
def test_committed_models_are_what_the_release_preset_trains(kind):
    """The card says `--preset release`: the committed architecture and epoch count must be that preset's."""
    from models.config import get_preset

    architecture = json.loads((_version_dir(kind) / "config.json").read_text())["architecture"]
    model_config, train_config = get_preset(kind, "release")
    shared = {name: value for name, value in architecture.items() if hasattr(model_config, name)}
    assert shared and shared == {name: getattr(model_config, name) for name in shared}
    card = _card(kind)
    if train_config.max_steps is not None:  # a step budget (the GPT) ends before the epoch count
        assert card["steps"] == train_config.max_steps
    else:
        assert card["epochs_completed"] == train_config.epochs


@pytest.mark.parametrize("kind", KINDS)
def test_model_cards_state_how_the_model_was_made(kind):
    card = (_version_dir(kind) / "README.md").read_text()
    for needed in (f"python -m models.train {kind} --preset release", "parameters", "train seconds",
                   "float16", "![training curves](curves.png)"):
        assert needed in card, needed
    assert (_version_dir(kind) / "curves.png").stat().st_size > 10_000
