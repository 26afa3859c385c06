"""The model repository, in Triton's shape: `ROOT/<model-name>/<version>/` with the ONNX file(s), `config.json`,
`tokenizer.json` for text models and a model card (`metrics.json`, `README.md`).

The loader takes the highest version unless told otherwise. The repository is read live (operators copy versions
into it while the server runs), so what is in it is never trusted: a model folder whose name a request or
`TSERVE_MODELS` could not name, a version folder whose name is not a canonical version number (`03`, `²`,
`latest`), or a version whose `config.json` is missing, half-written, of an unknown kind or not what its kind's
schema says (`service.config_schema`: the field named) is skipped, logged once and reported by `problems()` (the
repository index shows it as UNAVAILABLE with the reason), never an error for the listing. Hidden folders (the
exporter's staging copies) are ignored. Nothing here imports torch. Given a model name, the root is instead one
model's folder (`ROOT/<version>/`, as KServe's storage initializer fills /mnt/models), served under that name.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.config_schema import GPT, KINDS, TRANSLATION, VARIANT_DEFAULTS, VIT, config_problems
from service.errors import json_error_reason

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
# The kinds a version's config.json may name (`KINDS`: `TRANSLATION`, `GPT`, `VIT`) and how its graphs compute
# (`VARIANT_DEFAULTS`) are its schema's (`service.config_schema`); the engines' modules import them from here.
DECODING_KINDS = (TRANSLATION, GPT)  # the kinds with a KV cache
# A version as a folder name or as a request writes it: ASCII digits without a leading zero (so `03` cannot stand
# beside `3` as a second copy of it), at most 9 of them (every such number fits an int32, as Triton's versions do).
VERSION_DIGITS = 9
MAX_VERSION = 10**VERSION_DIGITS - 1
VERSION_PATTERN = re.compile(rf"[1-9][0-9]{{0,{VERSION_DIGITS - 1}}}")
# A model name: what a URL path segment and a `TSERVE_MODELS` spec (`name:version`) can carry unchanged.
MODEL_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class RepositoryError(Exception):
    """A model or version that does not exist, or a version folder that is not a valid model."""


class VersionNotFound(RepositoryError):
    """No such model, or no such version of it, in the repository (as opposed to one that is there but broken)."""


def parse_version(text: str) -> int | None:
    """A canonical version number written as text -> the int; anything else (`03`, `²`, `-1`, `1.0`) -> None."""
    return int(text) if VERSION_PATTERN.fullmatch(text) else None


@dataclass(frozen=True)
class ModelVersion:
    name: str
    version: int
    path: Path
    config: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.config["kind"]

    @property
    def variant(self) -> dict[str, str]:
        """Its graphs' variant (`VARIANT_DEFAULTS`' keys; `kv_cache` only for a kind that decodes)."""
        return {key: str(self.config.get(key, default)) for key, default in VARIANT_DEFAULTS.items()
                if key != "kv_cache" or self.kind in DECODING_KINDS}


@dataclass(frozen=True)
class Problem:
    """A folder in the repository that is not a usable model or version: `version` is the folder's name under
    the model ("" when the model folder itself is the problem)."""
    name: str
    version: str
    reason: str

    @property
    def folder(self) -> str:
        """`name/version`, or the model folder's name."""
        return f"{self.name}/{self.version}" if self.version else self.name


def read_config(path: Path) -> dict[str, Any]:
    """The `config.json` of a version folder, checked to be a JSON object of a known kind that its kind's schema
    validates (`service.config_schema`); RepositoryError naming the file and the invalid fields else."""
    file = path / CONFIG_FILE
    if not file.is_file():
        raise RepositoryError(f"{file} does not exist")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        reason = error if isinstance(error, OSError) else json_error_reason(error)
        raise RepositoryError(f"{file} is not a readable JSON model config: {reason}") from None
    if not isinstance(config, dict) or config.get("kind") not in KINDS:
        kind = config.get("kind") if isinstance(config, dict) else config
        raise RepositoryError(f"{file}: kind must be one of {KINDS}, got {kind!r}")
    if (problems := config_problems(config["kind"], config)) is not None:
        raise RepositoryError(f"{file}: {problems}")
    return config


class ModelRepository:
    """root: a repository (`root/<name>/<version>/`); with `model_name` (`TSERVE_MODEL_NAME`), one model's folder
    (`root/<version>/`) holding the only model there is, served under that name."""

    def __init__(self, root: str | Path, model_name: str = ""):
        self.root = Path(root)
        self.model_name = model_name
        self._reported: set[Problem] = set()  # problems already logged: the repository is read on every listing

    def folder(self, name: str) -> Path | None:
        """Where a model's version folders are; None for a name that cannot be a model here."""
        if self.model_name:
            return self.root if name == self.model_name else None
        return self.root / name if MODEL_NAME_PATTERN.fullmatch(name) else None

    def _model_folders(self) -> list[str]:
        """The names of the models the repository may hold, valid or not."""
        return [self.model_name] if self.model_name else [p.name for p in self._folders(self.root)]

    def _folders(self, path: Path) -> list[Path]:
        try:
            return sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:  # gone or unreadable since it was listed
            return []

    def _report(self, problem: Problem) -> Problem:
        if problem not in self._reported:
            self._reported.add(problem)
            log.warning("model repository %s: skipping %s: %s", self.root, problem.folder, problem.reason)
        return problem

    def _scan(self, name: str) -> tuple[dict[int, dict[str, Any]], list[Problem]]:
        """The valid versions of a model (version -> config) and the version folders that are not valid."""
        configs, problems = {}, []
        if (folder := self.folder(name)) is None:
            return configs, problems
        for path in self._folders(folder):
            version = parse_version(path.name)
            if version is None:
                problems.append(self._report(Problem(name, path.name, self._not_a_version(path))))
                continue
            try:
                configs[version] = read_config(path)
            except RepositoryError as error:
                problems.append(self._report(Problem(name, path.name, str(error))))
        return configs, problems

    def _not_a_version(self, path: Path) -> str:
        reason = "not a version: a version folder is named by a positive integer without leading zeros"
        if self.model_name and any(parse_version(p.name) for p in self._folders(path)):
            reason += (f" (with a model name, {self.root} is one model's folder, <version>/{CONFIG_FILE}; this "
                       f"folder holds versions itself: point TSERVE_REPOSITORY or the storageUri at it)")
        return reason

    def model_names(self) -> list[str]:
        return sorted(name for name in self._model_folders()
                      if MODEL_NAME_PATTERN.fullmatch(name) and self._scan(name)[0])

    def versions(self, name: str) -> list[int]:
        return sorted(self._scan(name)[0])

    def problems(self) -> list[Problem]:
        """Every folder of the repository that is skipped, and why."""
        problems = []
        for name in self._model_folders():
            if not MODEL_NAME_PATTERN.fullmatch(name):
                problems.append(self._report(Problem(name, "", "not a model name: letters, digits, '_', '.' "
                                                               "and '-', starting with a letter or digit")))
            else:
                problems += self._scan(name)[1]
        return problems

    def get(self, name: str, version: int | None = None) -> ModelVersion:
        """A valid version (default: the highest); VersionNotFound when there is none such, RepositoryError (with
        the reason) when its folder is there but not a valid model."""
        configs, problems = self._scan(name)
        if version is not None and (broken := [p for p in problems if p.version == str(version)]):
            raise RepositoryError(f"model {name!r} version {version} is not a valid model: {broken[0].reason}")
        if version is None and not configs and problems:
            reasons = "; ".join(f"{p.version}: {p.reason}" for p in problems)
            raise RepositoryError(f"model {name!r} has no valid version in {self.root} ({reasons})")
        if not configs and not problems:
            known = ", ".join(self.model_names()) or "none"
            raise VersionNotFound(f"model {name!r} not found in {self.root} (models: {known})")
        if version is None:
            version = max(configs)
        elif version not in configs:
            raise VersionNotFound(f"model {name!r} has no version {version} (versions: {sorted(configs)})")
        return ModelVersion(name, version, self.folder(name) / str(version), configs[version])

    def next_version(self, name: str) -> int:
        """One above every version folder, valid or not (a broken version's number is not reused)."""
        folder = self.folder(name)
        taken = [parse_version(p.name) for p in self._folders(folder)] if folder else []
        return max((v for v in taken if v is not None), default=0) + 1
