"""Triton's statistics read from the Prometheus metrics (`service.api.oip.statistics`): each figure is the sum of
the samples that carry the version's labels, and nothing of another model or version leaks in."""

from __future__ import annotations

import pytest

from service.api.oip.statistics import model_statistics
from service.models.registry import LoadedModel
from service.observability.metrics import Metrics


def loaded(name: str, kind: str, version: int = 1) -> LoadedModel:
    return LoadedModel(name=name, version=version, kind=kind, engine=None, scheduler=None,
                       provider="CPUExecutionProvider", load_seconds=0.0)


def request(metrics: Metrics, model: str, version: str, status: int, seconds: float, api: str = "oip") -> None:
    metrics.request_duration.labels(endpoint="/x", api=api, model=model, version=version, mode="classify",
                                    status=str(status)).observe(seconds)


def test_an_image_model_s_statistics():
    metrics = Metrics()
    request(metrics, "vit", "1", 200, 0.5)
    request(metrics, "vit", "1", 200, 0.25, api="native")  # every API counts
    request(metrics, "vit", "1", 504, 1.0)
    request(metrics, "vit", "2", 200, 9.0)  # another version
    request(metrics, "gpt", "1", 500, 9.0)  # another model
    for wait in (0.1, 0.2):
        metrics.queue_wait.labels(model="vit", version="1", mode="classify").observe(wait)
    for size in (1, 1, 3):
        metrics.batch_size.labels(model="vit", version="1").observe(size)
    for seconds in (0.01, 0.02, 0.03):
        metrics.batch_seconds.labels(model="vit", version="1").observe(seconds)
    metrics.last_batch.labels(model="vit", version="1").set(1_700_000_000.25)
    metrics.images.labels(model="vit", version="1").inc(5)
    (stats,) = model_statistics(metrics, [loaded("vit", "vit")])["model_stats"]
    assert (stats["name"], stats["version"], stats["inference_count"], stats["execution_count"]) == ("vit", "1", 5, 3)
    inference = stats["inference_stats"]
    assert inference["success"] == {"count": 2, "ns": 750_000_000}
    assert inference["fail"] == {"count": 1, "ns": 1_000_000_000}
    assert inference["queue"]["count"] == 2 and inference["queue"]["ns"] == pytest.approx(300_000_000, abs=1)
    assert inference["compute_infer"]["count"] == 3
    assert inference["compute_infer"]["ns"] == pytest.approx(60_000_000, abs=1)
    assert stats["last_inference"] == 1_700_000_000_250  # milliseconds since the epoch
    assert all(inference[k] == {"count": 0, "ns": 0} for k in ("compute_input", "compute_output"))
    assert [(b["batch_size"], b["compute_infer"]["count"]) for b in stats["batch_stats"]] == [(1, 2), (4, 1)]


def test_a_text_model_counts_its_sequences_and_an_idle_one_is_all_zero():
    metrics = Metrics()
    for mode in ("greedy", "beam", "greedy"):
        metrics.queue_wait.labels(model="gpt", version="3", mode=mode).observe(0.01)
    (gpt, idle) = model_statistics(metrics, [loaded("gpt", "gpt", 3), loaded("translation", "translation")])[
        "model_stats"]
    assert gpt["inference_count"] == 3 and gpt["inference_stats"]["queue"]["count"] == 3
    assert idle["inference_count"] == 0 and idle["batch_stats"] == []
    assert idle["inference_stats"]["success"] == {"count": 0, "ns": 0}
