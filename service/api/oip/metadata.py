"""The Open Inference Protocol's metadata, whatever carries it (REST: `service.api.oip.router`; gRPC:
`service.api.oip.grpc`), from the model registry: the server's metadata and extensions, a model's metadata (its
signature and loaded versions), Triton's model configuration and statistics extensions, and the version a request
names (a version number; none: the model's active version). Each builds the protocol's JSON
object; gRPC reads the same objects into its messages."""

from __future__ import annotations

import service
from service.api.oip.signatures import PLATFORM, model_config, signature
from service.api.oip.statistics import model_statistics
from service.models import control
from service.models.registry import LoadedModel, ModelRegistry
from service.observability.metrics import Metrics

EXTENSIONS = ["binary_tensor_data", "classification", "model_configuration", "statistics"]


def server_metadata() -> dict:
    return {"name": service.NAME, "version": service.__version__, "extensions": EXTENSIONS}


def parse_version(version: str | None) -> int | None:
    """A request's version: None or "" (gRPC's unset string) is the active one; else a version number
    (`service.models.control.parse_version`: ASCII digits, no leading zero; 400 otherwise)."""
    return control.parse_version(version) if version else None


def resolve(registry: ModelRegistry, name: str, version: str | None) -> LoadedModel:
    """The loaded version a metadata request names: 404 unknown, 503 loading or draining."""
    return registry.resolve(None, name, parse_version(version))


def loaded_versions(registry: ModelRegistry) -> dict:
    """A copy of the loaded versions by (name, version): model control changes the registry's while we read."""
    return dict(registry.loaded)


def versions_of(registry: ModelRegistry, name: str) -> list[int]:
    return sorted(v for (n, v) in loaded_versions(registry) if n == name)


def model_metadata(registry: ModelRegistry, loaded: LoadedModel) -> dict:
    tensors = signature(loaded)

    def described(tensors):
        return [{"name": n, "datatype": d, "shape": s} for n, d, s in tensors]

    return {"name": loaded.name, "versions": [str(v) for v in versions_of(registry, loaded.name)],
            "platform": PLATFORM, "inputs": described(tensors.inputs), "outputs": described(tensors.outputs)}


def configuration(registry: ModelRegistry, loaded: LoadedModel) -> dict:
    return model_config(loaded, versions_of(registry, loaded.name))


def statistics(registry: ModelRegistry, metrics: Metrics, name: str | None, version: str | None) -> dict:
    """Every loaded version's statistics (no name), a model's (every loaded version of it), or one version's."""
    every = sorted(loaded_versions(registry).items())
    if not name:
        versions = [loaded for _, loaded in every]
    elif not version:
        model = resolve(registry, name, None).name  # 404 for an unknown model
        versions = [loaded for (n, _), loaded in every if n == model]
    else:
        versions = [resolve(registry, name, version)]
    return model_statistics(metrics, versions)
