"""The committed model repository: the release versions of each kind (version 1 as exported from the trained run,
later ones derived from it by `python -m export.convert` or exported straight into a variant), quality targets met
by every version, within the size budget, and served as committed (no training, no download; the highest version)
with outputs a user would accept.

The cards' figures are measured on the full data sets, which CI does not have; so every committed graph is also
MEASURED here, with ONNX Runtime on the committed fixture set (tests/fixtures/data: the first 300 test sentences,
10,000 tinyshakespeare characters, 500 test images), and compared with its card within what a sample of that size
can resolve (`SAMPLE_SIGMAS` standard errors). That catches a regression in the graphs themselves (a broken
rewrite, weights, attention or cache), which the cards alone cannot. About 25 s on 2 cores.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import sacrebleu
from PIL import Image

from service.engines.runtime import RuntimeOptions
from service.repository import ModelRepository
from service.settings import Settings
from tests.support import ROOT

REPOSITORY = ROOT / "model_repository"
KINDS = ("translation", "gpt", "vit")


VERSIONS = [(kind, version) for kind in KINDS for version in ModelRepository(REPOSITORY).versions(kind)]
# What every committed version (each graph's own measurement and its PyTorch model's) must reach: the first release's
# targets. Versions kept for comparison meet these (none now: vit/3 and gpt/3 made room for gpt/4 in the 40 MB).
FLOORS = {"bleu": 35, "val_loss": 1.55, "test_accuracy": 91.5}
# The served (highest) versions. The GPT: issue 26's <= 1.45 nats/char (version 4: 1.4274, 6 layers trained on a GPU;
# version 3: 1.4709). BLEU: issue 26's
# 38.5 (version 4: 38.61 for PyTorch, 38.6 through the service; length penalty chosen on val, six encoder layers
# chosen over version 3's three on val BLEU, 38.72 vs 38.42). The ViT's: issue 26's 93.0%, every choice on a
# validation split held out of the training images (version 4: 93.06% test with its convolutional stem and
# test-time flip averaging, both chosen on validation).
TARGETS = {"bleu": 38.5, "val_loss": 1.45, "test_accuracy": 93.0}


def _version_dir(kind: str, version: int) -> Path:
    return REPOSITORY / kind / str(version)


def _card(kind: str, version: int) -> dict:
    return json.loads((_version_dir(kind, version) / "metrics.json").read_text())


def _meets(metric: str, value: float, bounds: dict[str, float] = FLOORS) -> bool:
    return value <= bounds[metric] if metric == "val_loss" else value >= bounds[metric]


@pytest.mark.parametrize("kind, version", VERSIONS)
def test_release_targets_are_met_and_recorded(kind, version):
    from export.repository import QUALITY_METRIC

    card = _card(kind, version)
    assert card["preset"] == "release"
    counts = {"translation": ("test_2016_flickr_sentences", 1000), "gpt": ("val_tokens", 111_540),  # the whole
              "vit": ("test_images", 10_000)}[kind]  # test set / last 10% of tinyshakespeare
    assert card[counts[0]] == counts[1]
    metric = QUALITY_METRIC[kind]
    assert _meets(metric, card[metric])
    if kind == "vit" and "conversion" not in card:
        assert _meets(metric, card["export_checks"]["onnx_test_accuracy"])  # the exported graph itself, too


# --- every committed graph measured on the fixture set ---------------------------------------------------------

# How many standard errors of the fixture-sized sample a graph's figure may sit from its card's full-set figure.
# The fixture subset is fixed, so a graph either passes or fails on it for good: at 3 a sound graph fails only if
# the first examples happen to be a 0.3% outlier, while a regression larger than the band (a ViT a few points worse,
# BLEU ~5 lower, a GPT whose loss rises past its validation loss) fails.
SAMPLE_SIGMAS = 3
BOOTSTRAP_RESAMPLES = 200  # of the fixture's sentences, for BLEU's standard error (no closed form); ~2 s
BOOTSTRAP_SEED = 0
FIXTURE_OPTIONS = RuntimeOptions(intra_op_threads=2)
# The GPT's fixture text is training text for the release models, so its card's held-out loss bounds the fixture
# loss from one side only; these are the committed graphs' own fixture losses (nats, AMD EPYC, ONNX Runtime), held
# two-sided within `GPT_FIXTURE_LOSS_TOLERANCE`. Re-measure them when a GPT version is committed.
GPT_FIXTURE_LOSS = {4: 1.0393}  # gpt/1 and gpt/3 (removed for the 40 MB budget) measured 1.1495 and 1.1542
# How far another CPU's kernels may move a committed graph's fixture loss: 5x the tolerance a graph variant may move
# a loss (`export.tolerances.TOLERANCES["val_loss"]`, 0.002; the int8 gpt/3 moved its validation loss 0.0002 from
# float32 on AMD EPYC), since int8 kernels differ by ISA. Still tight: gpt/3's logits scaled by 0.9 move its fixture
# loss by 0.006 and by 0.7 far more (measured, AMD EPYC).
GPT_FIXTURE_LOSS_TOLERANCE = 0.01


def _standard_error_of_bleu(hypotheses: list[str], references: list[str]) -> float:
    """Bootstrap standard error of corpus BLEU over the sentences (resampled with replacement, fixed seed)."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    scores = []
    for _ in range(BOOTSTRAP_RESAMPLES):
        picked = rng.integers(0, len(hypotheses), len(hypotheses))
        scores.append(sacrebleu.corpus_bleu([hypotheses[i] for i in picked], [[references[i] for i in picked]]).score)
    return float(np.std(scores, ddof=1))


def _fixture_bleu(version, card: dict, data_dir: Path) -> tuple[float, float, int]:
    """(sacreBLEU, its standard error, sentences) of the graphs on the fixture's test_2016_flickr sentences, decoded
    as the service decodes `/v1/translate` by default: beam 4, the model's length penalty (the card's, chosen on
    val), the default length budget."""
    from models.data import load_multi30k
    from service.decoding import BeamSearch
    from service.engines.translation import TranslationEngine

    engine = TranslationEngine(version, FIXTURE_OPTIONS)
    assert engine.length_penalty == card["length_penalty"]
    pairs = load_multi30k(data_dir, "test_2016_flickr")
    sources = [engine.source_ids(" ".join(de.split())) for de, _ in pairs]
    searches = engine.translate_ids(sources, lambda i: BeamSearch(
        4, min(engine.default_max_new_tokens(len(sources[i])), engine.max_target_length - 1), engine.eos_id,
        length_penalty=engine.length_penalty, prefix=[engine.bos_id]))
    hypotheses = [engine.tokenizer.decode(search.results()[0].tokens) for search in searches]
    references = [en for _, en in pairs]
    bleu = sacrebleu.corpus_bleu(hypotheses, [references]).score
    return bleu, _standard_error_of_bleu(hypotheses, references), len(pairs)


def _fixture_loss(version, data_dir: Path) -> tuple[float, float, int]:
    """(mean next-token loss in nats, its standard error, windows) of the graph on the fixture's validation
    characters, as `export.checks.gpt_validation_loss` scores them: consecutive context-length windows, the error
    from the spread of the windows' own means (neighbouring tokens are not independent, windows nearly are)."""
    from export.checks import gpt_validation_loss
    from models.data import load_shakespeare
    from service.engines.gpt import GPTEngine

    engine = GPTEngine(version, FIXTURE_OPTIONS)
    _, val_text = load_shakespeare(data_dir)
    ids = np.asarray(engine.tokenizer.encode(val_text).ids, dtype=np.int64)
    T = engine.context_length
    windows = [gpt_validation_loss(engine, ids[start : start + T + 1]) for start in range(0, len(ids) - T, T)]
    loss = gpt_validation_loss(engine, ids)
    assert loss == pytest.approx(np.mean(windows), abs=1e-9)  # the same windows, scored one by one
    return loss, float(np.std(windows, ddof=1) / np.sqrt(len(windows))), len(windows)


def _fixture_accuracy(version, data_dir: Path) -> tuple[float, int]:
    """(top-1 accuracy in percent, images) of the graph on the fixture's test images, preprocessed as served."""
    from export.checks import vit_test_accuracy
    from models.data import load_fashion_mnist
    from service.engines.vit import ViTEngine

    images, labels = load_fashion_mnist(data_dir, "test")
    return vit_test_accuracy(ViTEngine(version, FIXTURE_OPTIONS), images, labels), len(labels)


@pytest.mark.parametrize("kind, version", VERSIONS)
def test_each_committed_graph_measures_its_card_figure_on_the_fixtures(kind, version, data_dir):
    """Run the committed graphs with ONNX Runtime on the fixture set and compare with the card's figure, within
    `SAMPLE_SIGMAS` standard errors of a sample of the fixture's size:
    - translation: sacreBLEU of the default beam-4 decoding of the 300 fixture test sentences (the first of the
      card's 1,000) against the card's `bleu`, the error by bootstrap over the sentences;
    - ViT: accuracy on the 500 fixture test images (the first of the card's 10,000) against `test_accuracy`, the
      error binomial (`export.tolerances.accuracy_tolerance`, no floor);
    - GPT: loss on the fixture's 10,000 validation characters against `val_loss`. One-sided: the fixture is the
      first 100,000 characters of tinyshakespeare, which the release GPTs trained on, so a sound graph scores
      below its card's held-out loss (measured: 1.149, 1.154 and 1.039 nats against 1.529, 1.471 and 1.427 for
      gpt/1, 3 and 4); a graph whose loss rises above it by more than the band fails. Because that bound is
      loose, the loss is also held two-sided to the graph's own recorded fixture loss (`GPT_FIXTURE_LOSS`) within `GPT_FIXTURE_LOSS_TOLERANCE`."""
    from export.tolerances import accuracy_tolerance

    card = _card(kind, version)
    model = ModelRepository(REPOSITORY).get(kind, version)
    if kind == "translation":
        bleu, error, sentences = _fixture_bleu(model, card, data_dir)
        assert sentences == 300 and error > 0
        assert abs(bleu - card["bleu"]) <= SAMPLE_SIGMAS * error, (bleu, card["bleu"], error)
    elif kind == "vit":
        accuracy, images = _fixture_accuracy(model, data_dir)
        tolerance = SAMPLE_SIGMAS * accuracy_tolerance(card["test_accuracy"], images, 0.0)
        assert images == 500
        assert abs(accuracy - card["test_accuracy"]) <= tolerance, (accuracy, card["test_accuracy"], tolerance)
    else:
        loss, error, windows = _fixture_loss(model, data_dir)
        assert windows >= 30 and error > 0
        assert loss <= card["val_loss"] + SAMPLE_SIGMAS * error, (loss, card["val_loss"], error)
        assert abs(loss - GPT_FIXTURE_LOSS[version]) <= GPT_FIXTURE_LOSS_TOLERANCE, (loss, GPT_FIXTURE_LOSS[version])


# --- how each version was made -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, version", VERSIONS)
def test_each_version_records_the_checks_of_how_it_was_made(kind, version):
    """A version made by `python -m export.convert` (config.json's `derived_from`): its variant in config.json,
    and its own quality, measured on the full set, within the tolerances of the float32 model and at the release
    target; the source's card figures are kept in the derived card. None is committed now (the version-3 models
    were exported straight into their variants; version 2 measured GPT val loss 1.5291 vs 1.5291, BLEU 36.95 vs
    36.94, ViT 92.14% vs 92.15%, git history has them). A version exported from a trained run: no conversion
    record, and the exported graph's own figure on the card's data (`SERVED_FIGURE`) next to PyTorch's, within
    the tolerance of its variant."""
    from export.repository import QUALITY_METRIC, SERVED_FIGURE
    from export.tolerances import quality_tolerance, within

    config = json.loads((_version_dir(kind, version) / "config.json").read_text())
    card = _card(kind, version)
    count = card.get({"gpt": "val_tokens", "translation": "test_2016_flickr_sentences", "vit": "test_images"}[kind])
    if "derived_from" not in config:
        assert "conversion" not in card and config["version"] == version
        metric, (name, places) = QUALITY_METRIC[kind], SERVED_FIGURE[kind]
        measured = card["export_checks"][name]
        assert card["export_checks"][f"{name}_minus_pytorch"] == pytest.approx(
            round(measured - card[metric], places), abs=10**-places / 2)
        assert within(metric, measured - card[metric], quality_tolerance(metric, card[metric], count))
        return
    assert config["derived_from"] < version and config["version"] == version
    conversion = card["conversion"]
    assert (conversion["weights"], conversion["attention"], conversion["kv_cache"]) == (
        config["weights"], config["attention"], config["kv_cache"])
    quality = conversion["quality"]
    assert quality["reference"] == card[quality["metric"]]
    assert quality["tolerance"] == quality_tolerance(quality["metric"], quality["reference"], count)
    assert within(quality["metric"], quality["delta"], quality["tolerance"])
    assert _meets(quality["metric"], quality["measured"])
    assert conversion["command"].startswith("python -m export.convert")


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
        assert answer.json()["translations"][0][0]["text"] == "Two dogs play in the snow."

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
        assert correct >= 29  # measured: 30 of the first 32 test images (vit/4: 93.06% over all 10,000)


SERVED = [(kind, max(v for k, v in VERSIONS if k == kind)) for kind in KINDS]  # the highest version of each


@pytest.mark.parametrize("kind, version", SERVED)
def test_served_versions_meet_the_release_v2_targets(kind, version):
    """The PyTorch model's figure on the card and the served graph's own measurement of it (an export's, or a
    conversion's), both."""
    from export.repository import QUALITY_METRIC, SERVED_FIGURE

    card = _card(kind, version)
    metric = QUALITY_METRIC[kind]
    measured = card["export_checks"].get(SERVED_FIGURE[kind][0],
                                         card.get("conversion", {}).get("quality", {}).get("measured"))
    assert measured is not None
    assert _meets(metric, card[metric], TARGETS) and _meets(metric, measured, TARGETS), (card[metric], measured)


def _as_json(value):
    return list(value) if isinstance(value, tuple) else value


@pytest.mark.parametrize("kind, version", SERVED)
def test_served_models_are_what_the_release_preset_trains(kind, version):
    """The card says `--preset release`: the served (highest) version's architecture and epoch count must be that
    preset's (older versions were trained by earlier release presets, their cards say how)."""
    from models.config import CHOSEN_AT_EVALUATION, get_preset

    architecture = json.loads((_version_dir(kind, version) / "config.json").read_text())["architecture"]
    model_config, train_config = get_preset(kind, "release")
    shared = {name: value for name, value in architecture.items()
              if hasattr(model_config, name) and name not in CHOSEN_AT_EVALUATION}
    assert shared and shared == {name: _as_json(getattr(model_config, name)) for name in shared}
    card = _card(kind, version)
    if train_config.max_steps is not None:  # a step budget (the GPT) ends before the epoch count
        assert card["steps"] == train_config.max_steps
    else:
        assert card["epochs_completed"] == train_config.epochs


@pytest.mark.parametrize("kind, version", VERSIONS)
def test_model_cards_state_how_the_model_was_made(kind, version):
    card = (_version_dir(kind, version) / "README.md").read_text()
    needed = [f"python -m models.train {kind} --preset release", "parameters", "train seconds", "float16",
              "![training curves](curves.png)"]
    config = json.loads((_version_dir(kind, version) / "config.json").read_text())
    if "derived_from" in config:  # derived: how, into which variant, and what was measured against what
        needed += [f"python -m export.convert --repository model_repository --name {kind}",
                   f"weights `{config['weights']}`", f"attention `{config['attention']}`", "Conversion checks",
                   "(PyTorch, float32)", "tolerance"]
    elif config.get("weights") == "int8":  # exported straight into a variant: its check against float32
        needed += ["int8", "within_tolerance"]
    for text in needed:
        assert text in card, text
    assert (_version_dir(kind, version) / "curves.png").stat().st_size > 10_000
