"""Private copies of a model repository's versions, for the tests that add, break or rewrite versions without
touching the shared tiny repository (tests/conftest.py's `tiny_repository_copy` builds on this)."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

SOURCE_VERSION = "1"  # the tiny repository holds version 1 of each model


def copy_versions(source: Path, target: Path, kinds: Iterable[str], versions: Iterable[str] = (SOURCE_VERSION,)
                  ) -> Path:
    """Version 1 of each model in `kinds` from the repository `source`, copied into `target` as each of
    `versions`; returns `target`."""
    for kind in kinds:
        for version in versions:
            shutil.copytree(source / kind / SOURCE_VERSION, target / kind / version)
    return target


def add_in_place_gpt(repository: Path, data_dir: Path) -> Path:
    """The GPT's version 1 in `repository` converted by the real CLI (`export.convert`) into version 2: fused
    attention and the in-place step graph; returns `repository`."""
    from export.convert import main as convert_main

    assert convert_main(["--repository", str(repository), "--name", "gpt", "--from-version", SOURCE_VERSION,
                         "--to-version", "2", "--data-dir", str(data_dir), "--attention", "mha",
                         "--kv-cache", "inplace"]) == 0
    return repository
