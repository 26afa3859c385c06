"""A version's config.json is checked against its kind's schema when the repository reads it (issue 51, "every
file the service reads at start-up is validated against a schema"; `service.config_schema`):

- table-style cases, one broken field each (missing, wrong type, negative id, an id past the vocabulary, a file
  name escaping the version folder, a NaN length penalty, labels that are not strings...): the version is skipped
  with a reason naming the file and the field (`config.json: files.decoder: Field required`), never a bare KeyError
  text or a TypeError from an engine; what the exporter writes besides stays free;
- every committed version (model_repository/) and every version the exporter writes (the tiny repository) passes;
- a broken version beside a good one: listed without it, logged once, reported with the reason;
- model control: loading a version with a broken config.json is a 400 naming the field, and the serving version
  serves on; at start-up such a version is skipped, and the one below it serves.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from service.config_schema import MAX_REASON_CHARS, MAX_REPORTED_ERRORS
from service.repository import CONFIG_FILE, ModelRepository, RepositoryError, read_config
from service.settings import Settings
from tests.support import ROOT
from tests.support.images import png_bytes

COMMITTED = sorted((ROOT / "model_repository").glob(f"*/*/{CONFIG_FILE}"))
BASES = {path.parent.parent.name: json.loads(path.read_text()) for path in COMMITTED}  # kind -> its release config
ESCAPES = ["../1/decoder.onnx", "../../gpt/4/decoder.onnx", "/etc/passwd", "sub/decoder.onnx", "..", ".", "",
           ".hidden.onnx", "a\\b.onnx", "decoder.onnx\x00", "x" * 256]


def _set(path: str, value):
    """A change that sets the field at the dotted `path` (creating nothing: the parents exist in the base)."""
    *parents, last = path.split(".")

    def change(config: dict) -> None:
        for key in parents:
            config = config[key]
        config[last] = value

    return change


def _drop(path: str):
    *parents, last = path.split(".")

    def change(config: dict) -> None:
        for key in parents:
            config = config[key]
        del config[last]

    return change


def _no_decoder(config: dict) -> None:
    config["files"].pop("decoder")
    config["files"].pop("decoder_step", None)


# (kind, the change, what the reason says after "config.json: ")
BROKEN = {
    "no files": ("gpt", _drop("files"), "files: Field required"),
    "no decoder": ("gpt", _drop("files.decoder"), "files.decoder: Field required"),
    "files a list": ("gpt", _set("files", ["decoder.onnx"]), "files: Input should be a valid dictionary"),
    "decoder null": ("gpt", _set("files.decoder", None), "files.decoder: Input should be a valid string"),
    "decoder a number": ("gpt", _set("files.decoder", 1), "files.decoder: Input should be a valid string"),
    "an unknown graph": ("gpt", _set("files.tokenizer", "tokenizer.json"),
                         "files: 'tokenizer': a gpt version has no such graph (its graphs: decoder, decoder_step)"),
    "no architecture": ("gpt", _drop("architecture"), "architecture: Field required"),
    "no n_layers": ("gpt", _drop("architecture.n_layers"), "architecture.n_layers: Field required"),
    "vocab_size 0": ("gpt", _set("architecture.vocab_size", 0), "architecture.vocab_size: Input should be greater"),
    "vocab_size a string": ("gpt", _set("architecture.vocab_size", "257"),
                            "architecture.vocab_size: Input should be a valid integer"),
    "vocab_size a float": ("gpt", _set("architecture.vocab_size", 257.0),
                           "architecture.vocab_size: Input should be a valid integer"),
    "head_dim past int32": ("gpt", _set("architecture.head_dim", 2**31), "architecture.head_dim: Input should be less"),
    "no special_tokens": ("gpt", _drop("special_tokens"), "special_tokens: Field required"),
    "negative eos": ("gpt", _set("special_tokens.eos_id", -1),
                     "special_tokens.eos_id: Input should be greater than or equal to 0"),
    "eos true": ("gpt", _set("special_tokens.eos_id", True), "special_tokens.eos_id: Input should be a valid integer"),
    "eos past the vocabulary": ("gpt", _set("special_tokens.eos_id", 257),
                                "special_tokens: eos_id 257 is not below architecture.vocab_size 257"),
    "no context_length": ("gpt", _drop("context_length"), "context_length: Field required"),
    "negative context_length": ("gpt", _set("context_length", -5), "context_length: Input should be greater than 0"),
    "unknown weights": ("gpt", _set("weights", "int4"), "weights: must be one of fp32, fp16, int8"),
    "weights null": ("gpt", _set("weights", None), "weights: Input should be a valid string"),
    "unknown kv_cache": ("gpt", _set("kv_cache", "paged"), "kv_cache: must be one of concat, inplace"),
    "a variant's check not an object": ("gpt", _set("variants.fp32", "checked"),
                                        "variants.fp32: Input should be a valid dictionary"),
    "NaN length penalty": ("translation", _set("generation.length_penalty", math.nan),
                           "generation.length_penalty: Input should be a finite number"),
    "infinite length penalty": ("translation", _set("generation.length_penalty", -math.inf),
                                "generation.length_penalty: Input should be a finite number"),
    "length penalty a string": ("translation", _set("generation.length_penalty", "1.2"),
                                "generation.length_penalty: Input should be a valid number"),
    "generation null": ("translation", _set("generation", None), "generation: Input should be a valid dictionary"),
    "no encoder": ("translation", _drop("files.encoder"), "files.encoder: Field required"),
    "no decoder graph": ("translation", _no_decoder, "files: names no decoder graph (decoder or decoder_step)"),
    "no bos": ("translation", _drop("special_tokens.bos_id"), "special_tokens.bos_id: Field required"),
    "pad past the vocabulary": ("translation", _set("special_tokens.pad_id", 8000),
                                "special_tokens: pad_id 8000 is not below architecture.vocab_size 8000"),
    "no n_decoder_layers": ("translation", _drop("architecture.n_decoder_layers"),
                            "architecture.n_decoder_layers: Field required"),
    "max_source_length 0": ("translation", _set("max_source_length", 0), "max_source_length: Input should be greater"),
    "max_target_length a string": ("translation", _set("max_target_length", "256"),
                                   "max_target_length: Input should be a valid integer"),
    "no model graph": ("vit", _drop("files.model"), "files.model: Field required"),
    "labels not strings": ("vit", _set("labels", list(range(10))), "labels.0: Input should be a valid string"),
    "one label not a string": ("vit", lambda c: c["labels"].__setitem__(3, None),
                               "labels.3: Input should be a valid string"),
    "no labels": ("vit", _set("labels", []), "labels: List should have at least 1 item"),
    "labels a string": ("vit", _set("labels", "T-shirt/top"), "labels: Input should be a valid list"),
    "no image": ("vit", _drop("image"), "image: Field required"),
    "std 0": ("vit", _set("image.std", 0), "image.std: Input should be greater than 0"),
    "std NaN": ("vit", _set("image.std", math.nan), "image.std: Input should be a finite number"),
    "mean infinite": ("vit", _set("image.mean", math.inf), "image.mean: Input should be a finite number"),
    "4 channels": ("vit", _set("image.channels", 4), "image.channels: must be 1 (greyscale) or 3 (RGB)"),
    "size 0": ("vit", _set("image.size", 0), "image.size: Input should be greater than 0"),
    "response cache enable a string": ("gpt", _set("response_cache", {"enable": "true"}),
                                       "response_cache.enable: Input should be a valid boolean"),
    "response cache misspelt": ("vit", _set("response_cache", {"enabled": True}), "response_cache.enable: Field "
                                "required"),
    **{f"model file {name[:20]!r}": ("vit", _set("files.model", name), "files.model: must be a plain file name in the "
                                "version folder") for name in ESCAPES},
}

# What the exporter may write and the schema leaves free, or a valid shape the release does not use
VALID = {
    "the released config": ("gpt", lambda c: None),
    "training metadata beside": ("gpt", lambda c: c.update(run={"steps": 10, "seed": None}, note=[1, "x"])),
    "more architecture": ("gpt", _set("architecture.rotary", {"base": 10000})),
    "no variant keys (a plain float32 export)": ("gpt", lambda c: [c.pop(k) for k in ("weights", "attention",
                                                                                        "kv_cache", "variants")]),
    "variants null": ("gpt", _set("variants", None)),
    "no step graph": ("gpt", _drop("files.decoder_step")),
    "the in-place step graph alone": ("translation", lambda c: c["files"].update(decoder_step=c["files"].pop(
        "decoder"))),
    "no generation defaults": ("translation", _drop("generation")),
    "an integer length penalty": ("translation", _set("generation.length_penalty", 1)),
    "RGB images": ("vit", _set("image.channels", 3)),
    "an integer std": ("vit", _set("image.std", 1)),
    "the response cache on (Triton's response_cache.enable)": ("translation", _set("response_cache", {"enable": True})),
}


def _write(folder: Path, config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).write_text(json.dumps(config))  # NaN and Infinity as Python's json writes them
    return folder


def _changed(kind: str, change, base: dict | None = None) -> dict:
    config = copy.deepcopy(BASES[kind] if base is None else base)
    change(config)
    return config


def _broken_copy(source: Path, target: Path, change) -> Path:
    """A copy of the version folder `source` (its graphs and tokenizer too) as `target`, its config changed."""
    shutil.copytree(source, target)
    return _write(target, _changed(source.parent.name, change, json.loads((source / CONFIG_FILE).read_text())))


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_config_with_a_broken_field_is_refused_naming_the_file_and_the_field(tmp_path, case):
    kind, change, says = BROKEN[case]
    folder = _write(tmp_path / kind / "2", _changed(kind, change))
    with pytest.raises(RepositoryError) as refused:
        read_config(folder)
    assert f"{folder / CONFIG_FILE}: {says}" in str(refused.value), str(refused.value)


@pytest.mark.parametrize("case", list(VALID))
def test_what_the_schema_leaves_free_is_accepted(tmp_path, case):
    kind, change = VALID[case]
    config = _changed(kind, change)
    assert read_config(_write(tmp_path / kind / "2", config)) == config  # the config as written, nothing added


def test_a_reason_stays_one_readable_line_however_much_is_wrong(tmp_path):
    labels = list(range(100_000))
    folder = _write(tmp_path / "vit" / "2", _changed("vit", _set("labels", labels)))
    with pytest.raises(RepositoryError) as refused:
        read_config(folder)
    reason = str(refused.value)
    assert reason.count("Input should be a valid string") == MAX_REPORTED_ERRORS
    assert f"(and {len(labels) - MAX_REPORTED_ERRORS} more)" in reason
    assert len(reason) < len(str(folder)) + MAX_REASON_CHARS + 10


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_committed_version_passes(path):
    assert read_config(path.parent)["kind"] == path.parent.parent.name


def test_the_three_kinds_are_committed():
    assert set(BASES) == {"gpt", "translation", "vit"}


def test_a_broken_version_is_skipped_beside_a_good_one_and_logged_once(tmp_path, caplog):
    _write(tmp_path / "gpt" / "1", BASES["gpt"])
    _write(tmp_path / "gpt" / "2", _changed("gpt", _drop("files.decoder")))
    repository = ModelRepository(tmp_path)
    with caplog.at_level(logging.WARNING, logger="service.repository"):
        for _ in range(3):  # the repository is read on every listing; the problem is logged once
            assert repository.versions("gpt") == [1] and repository.get("gpt").version == 1
            (problem,) = repository.problems()
    says = f"{tmp_path / 'gpt' / '2' / CONFIG_FILE}: files.decoder: Field required"
    assert (problem.name, problem.version) == ("gpt", "2") and says in problem.reason
    assert [says in r.getMessage() for r in caplog.records] == [True]  # one line, naming the file and the field
    with pytest.raises(RepositoryError, match="files.decoder: Field required"):
        repository.get("gpt", 2)


# --- every version the exporter writes, and model control over the app ---------------------------------------------

@pytest.mark.slow
def test_every_version_the_exporter_writes_passes(tiny_repository):
    paths = sorted(tiny_repository.glob(f"*/*/{CONFIG_FILE}"))
    assert {p.parent.parent.name for p in paths} == {"gpt", "translation", "vit"}
    for path in paths:
        read_config(path.parent)


@pytest.fixture(scope="module")
def repository(tiny_repository_copy):
    return tiny_repository_copy("config-schema-repository", ("gpt", "vit"))


@pytest.fixture(scope="module")
def client(repository, serving):
    with serving(Settings(repository=repository, model_control=True)) as client:
        yield client


GREY = np.full((28, 28), 128, np.uint8)  # an image the tiny ViT classifies
SERVES = {"gpt": ("/v1/generate", {"prompt": "A", "max_new_tokens": 2}),
          "vit": ("/v1/classify", {"images": [base64.b64encode(png_bytes(GREY)).decode()]})}
LOADS = {  # (kind, the change, what the refusal says after "config.json: ")
    "gpt without files.decoder": ("gpt", _drop("files.decoder"), "files.decoder: Field required"),
    "gpt with a negative eos id": ("gpt", _set("special_tokens.eos_id", -1), "special_tokens.eos_id"),
    "gpt with a decoder outside its folder": ("gpt", _set("files.decoder", "../1/decoder.onnx"), "files.decoder"),
    "vit with labels that are not strings": ("vit", _set("labels", list(range(10))), "labels.0"),
}


def _error(response) -> str:
    error = response.json()["error"]
    return error if isinstance(error, str) else error["message"]


def _serves_version_1(client, kind: str) -> None:
    path, body = SERVES[kind]
    served = client.post(path, json=body)
    assert served.status_code == 200 and served.json()["version"] == 1, served.text


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LOADS))
def test_loading_a_version_with_a_broken_config_is_a_400_naming_the_field(client, repository, case):
    kind, change, says = LOADS[case]
    folder = _broken_copy(repository / kind / "1", repository / kind / "2", change)
    try:
        response = client.post(f"/v2/repository/models/{kind}/load", json={"parameters": {"version": "2"}})
        assert response.status_code == 400, response.text
        assert f"{CONFIG_FILE}: {says}" in _error(response) and "failed to load" in _error(response), response.text
        index = {(e["name"], e["version"]): e for e in client.post("/v2/repository/index").json()}
        assert index[(kind, "2")]["state"] == "UNAVAILABLE" and says in index[(kind, "2")]["reason"], index
        assert index[(kind, "1")]["state"] == "READY"
        assert client.app.state.registry.active[kind] == 1 and (kind, 2) not in client.app.state.registry.loaded
        _serves_version_1(client, kind)
        assert client.get("/health/ready").status_code == 200
    finally:
        shutil.rmtree(folder)


@pytest.mark.slow
def test_at_start_a_version_with_a_broken_config_is_skipped_with_one_log_line(tiny_repository, tmp_path, serving,
                                                                              caplog):
    repository = tmp_path / "repository"
    shutil.copytree(tiny_repository / "vit" / "1", repository / "vit" / "1")
    broken = _broken_copy(tiny_repository / "vit" / "1", repository / "vit" / "2", _set("image.std", 0))
    says = f"{broken / CONFIG_FILE}: image.std: Input should be greater than 0"
    with caplog.at_level(logging.INFO), serving(Settings(repository=repository, model_control=True)) as client:
        _serves_version_1(client, "vit")  # the highest valid version; the broken one never reached an engine
        client.post("/v2/repository/index")
    assert len([r for r in caplog.records if says in r.getMessage()]) == 1, [r.getMessage() for r in caplog.records]


@pytest.mark.slow
def test_at_start_a_model_whose_only_version_is_broken_is_not_ready_saying_why(tiny_repository, tmp_path):
    from fastapi.testclient import TestClient

    from service.app import create_app
    from tests.support.waiting import PATIENCE_S, poll

    broken = _broken_copy(tiny_repository / "vit" / "1", tmp_path / "repository" / "vit" / "2", _set("image.std", 0))
    with TestClient(create_app(Settings(repository=broken.parent.parent))) as client:
        poll(lambda: not client.app.state.registry.pending, PATIENCE_S, message="the loader done")
        ready = client.get("/health/ready")
        assert ready.status_code == 503, ready.text
        assert any(f"{broken / CONFIG_FILE}: image.std" in reason for reason in ready.json()["reasons"]), ready.text
