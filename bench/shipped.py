"""The graph variant the release models are served in, for the benchmarks' own random-weight models.

The committed model repository's highest version of each kind records in its config.json how its graphs were
rewritten (`export.repository.rewrite_graphs`: weights, attention, kv_cache) and the choices its evaluation made
that change the graph (the ViT's test-time flip averaging); the benchmarks build and rewrite their random-weight
exports the same way, so that they time what a user is served.
"""

from __future__ import annotations

from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
VARIANT_OPTIONS = ("weights", "attention", "kv_cache")


def shipped_variant(kind: str) -> dict[str, str]:
    """`rewrite_graphs`'s options for the release model of `kind` (empty: served as exported)."""
    from service.models.repository import ModelRepository

    config = ModelRepository(REPOSITORY).get(kind).config
    return {option: config[option] for option in VARIANT_OPTIONS if option in config}


def shipped_choices(kind: str) -> dict[str, object]:
    """The model-config fields the release model of `kind` was exported with that its evaluation chose (the ViT's
    `flip_average`), to build the benchmark's random-weight model alike."""
    from models.config import CHOSEN_AT_EVALUATION
    from service.models.repository import ModelRepository

    architecture = ModelRepository(REPOSITORY).get(kind).config.get("architecture", {})
    return {name: architecture[name] for name in CHOSEN_AT_EVALUATION if name in architecture}
