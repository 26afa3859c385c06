"""The model repository, in Triton's shape: `ROOT/<model-name>/<version>/` with the ONNX file(s), `config.json`,
`tokenizer.json` for text models and a model card (`metrics.json`, `README.md`).

The loader takes the highest version unless told otherwise. Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
KINDS = ("translation", "gpt", "vit")


class RepositoryError(Exception):
    """A model or version that does not exist, or a version folder that is not a valid model."""


@dataclass(frozen=True)
class ModelVersion:
    name: str
    version: int
    path: Path
    config: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.config["kind"]


class ModelRepository:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def model_names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and self.versions(p.name))

    def versions(self, name: str) -> list[int]:
        folder = self.root / name
        if not folder.is_dir():
            return []
        return sorted(int(p.name) for p in folder.iterdir()
                      if p.is_dir() and p.name.isdigit() and (p / CONFIG_FILE).is_file())

    def get(self, name: str, version: int | None = None) -> ModelVersion:
        versions = self.versions(name)
        if not versions:
            known = ", ".join(self.model_names()) or "none"
            raise RepositoryError(f"model {name!r} not found in {self.root} (models: {known})")
        if version is None:
            version = versions[-1]
        elif version not in versions:
            raise RepositoryError(f"model {name!r} has no version {version} (versions: {versions})")
        path = self.root / name / str(version)
        try:
            config = json.loads((path / CONFIG_FILE).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise RepositoryError(f"{path / CONFIG_FILE} is not a readable JSON model config: {error}") from error
        if config.get("kind") not in KINDS:
            raise RepositoryError(f"{path / CONFIG_FILE}: kind must be one of {KINDS}, got {config.get('kind')!r}")
        return ModelVersion(name, version, path, config)

    def next_version(self, name: str) -> int:
        versions = self.versions(name)
        return versions[-1] + 1 if versions else 1
