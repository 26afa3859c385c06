"""The served-equals-trained script (export.verify_served) against the tiny repository, through a real server on the
stored graphs (`--variant stored`, as every server of the suite: with `auto` the variant would be whichever this CPU
timed fastest at start-up, under load sometimes the tiny translator's int8, 0.25 BLEU off its float card)."""

from __future__ import annotations

import json
import shutil

from export.verify_served import main

STORED = ("--variant", "stored")


def test_served_quality_equals_the_model_cards(tiny_repository, data_dir, capsys):
    assert main(["--repository", str(tiny_repository), "--data-dir", str(data_dir), *STORED]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["skipped"] == []
    assert results["translation"]["sentences"] == 100 and results["translation"]["ok"]
    assert results["vit"]["images"] == 500 and results["vit"]["ok"]  # all 500 test images of the fixtures


def test_a_card_the_server_does_not_match_fails(tiny_repository, data_dir, tmp_path, capsys):
    repository = tmp_path / "repository"
    shutil.copytree(tiny_repository, repository)
    card_path = next(repository.glob("vit/*/metrics.json"))
    card = json.loads(card_path.read_text())
    # 5 points (25 of the 500 fixture images): more than the sample explains (one binomial standard error, ~2)
    card["test_accuracy"] += 5.0
    card_path.write_text(json.dumps(card))
    assert main(["--repository", str(repository), "--data-dir", str(data_dir), *STORED]) == 1
    results = json.loads(capsys.readouterr().out)
    assert results["translation"]["ok"] and not results["vit"]["ok"]
    assert results["vit"]["delta"] == -5.0 and 1.0 < results["vit"]["tolerance"] < 5.0


def test_kinds_selects_the_checks(tiny_repository, data_dir, capsys):
    assert main(["--repository", str(tiny_repository), "--data-dir", str(data_dir), "--kinds", "vit", *STORED]) == 0
    results = json.loads(capsys.readouterr().out)
    assert set(results) == {"vit", "skipped"} and results["vit"]["ok"]
