"""Triton's statistics extension (`GET /v2/models[/{m}[/versions/{v}]]/stats`, what
`tritonclient.http.InferenceServerClient.get_inference_statistics` returns): each loaded version's statistics in
Triton's JSON, read from the samples of the Prometheus metrics the service keeps anyway
(`service.observability.metrics`), so that the two can never disagree; no counter is kept twice.

Every API's requests count: `success` / `fail` from `tserve_request_duration_seconds`, `queue` from
`tserve_queue_wait_seconds`, `execution_count` and `batch_stats` from `tserve_batch_size`, `inference_count` from
`tserve_images` (text: the queue's count), `compute_infer` from `tserve_batch_seconds`, `last_inference` from
`tserve_last_batch_timestamp_seconds`, `cache_hit` / `cache_miss` from `tserve_response_cache_lookup_seconds` (the
lookup and, on a hit, rebuilding the answer; a miss's insertion is not in it). Reported as 0: `compute_input` /
`compute_output` and every `ns` of `batch_stats` (not measured apart).

Design notes (where each figure comes from): docs/architecture.md, service/api/oip/statistics.py.
"""

from __future__ import annotations

import math
from collections import defaultdict

from service.models.registry import LoadedModel
from service.repository import VIT
from service.observability.metrics import Metrics
from service.response_cache.cache import HIT, MISS

NS_PER_S = 1_000_000_000
SUCCESS = range(200, 300)  # the statuses of a request that succeeded
UNMEASURED = ("compute_input", "compute_output")  # inside compute_infer
MS_PER_S = 1000


def _duration(count: float = 0, seconds: float = 0.0) -> dict:
    return {"count": int(count), "ns": round(seconds * NS_PER_S)}


def _family(metric) -> str:
    """The family name of a declared metric, as its samples are collected."""
    (family,) = metric.describe()
    return family.name


class _Totals:
    """One version's sums over the metric samples that carry its labels."""

    def __init__(self):
        self.success = [0.0, 0.0]  # count, seconds
        self.fail = [0.0, 0.0]
        self.queue = [0.0, 0.0]
        self.images = 0.0
        self.executions = 0.0
        self.compute = [0.0, 0.0]  # batches timed, seconds
        self.last_batch = 0.0  # unix seconds
        self.buckets: dict[float, float] = defaultdict(float)  # upper bound -> cumulative count
        self.cache = {HIT: [0.0, 0.0], MISS: [0.0, 0.0]}  # response cache lookups by result: count, seconds


def _collect(metrics: Metrics) -> dict[tuple[str, str], _Totals]:
    """(model, version) -> its totals, in one pass over the registry's samples."""
    names = {_family(metrics.request_duration): "request", _family(metrics.queue_wait): "queue",
             _family(metrics.images): "images", _family(metrics.batch_size): "batch",
             _family(metrics.batch_seconds): "compute", _family(metrics.last_batch): "last",
             _family(metrics.response_cache_lookup_seconds): "cache"}
    totals: dict[tuple[str, str], _Totals] = defaultdict(_Totals)
    for family in metrics.registry.collect():
        what = names.get(family.name)
        if what is None:
            continue
        for sample in family.samples:
            labels, value = sample.labels, sample.value
            entry = totals[(labels.get("model", ""), labels.get("version", ""))]
            suffix = sample.name.removeprefix(family.name)
            if what == "request" and suffix in ("_count", "_sum"):
                pair = entry.success if int(labels["status"]) in SUCCESS else entry.fail
                pair[suffix == "_sum"] += value
            elif what == "queue" and suffix in ("_count", "_sum"):
                entry.queue[suffix == "_sum"] += value
            elif what == "images" and suffix == "_total":
                entry.images += value
            elif what == "batch" and suffix == "_count":
                entry.executions += value
            elif what == "batch" and suffix == "_bucket":
                entry.buckets[float(labels["le"])] += value
            elif what == "compute" and suffix in ("_count", "_sum"):
                entry.compute[suffix == "_sum"] += value
            elif what == "last":
                entry.last_batch = max(entry.last_batch, value)
            elif what == "cache" and suffix in ("_count", "_sum") and labels["result"] in entry.cache:
                entry.cache[labels["result"]][suffix == "_sum"] += value
    return totals


def _batch_stats(buckets: dict[float, float]) -> list[dict]:
    stats, below = [], 0.0
    for bound in sorted(b for b in buckets if math.isfinite(b)):
        count, below = buckets[bound] - below, buckets[bound]
        if count > 0:
            stats.append({"batch_size": int(bound), "compute_input": _duration(), "compute_output": _duration(),
                          "compute_infer": _duration(count)})
    return stats


def model_statistics(metrics: Metrics, versions: list[LoadedModel]) -> dict:
    """Triton's statistics response for these loaded versions."""
    totals = _collect(metrics)
    stats = []
    for loaded in versions:
        entry = totals.get((loaded.name, str(loaded.version)), _Totals())
        stats.append({
            "name": loaded.name,
            "version": str(loaded.version),
            "last_inference": round(entry.last_batch * MS_PER_S),
            "inference_count": int(entry.images if loaded.kind == VIT else entry.queue[0]),
            "execution_count": int(entry.executions),
            "inference_stats": {"success": _duration(*entry.success), "fail": _duration(*entry.fail),
                                "queue": _duration(*entry.queue), "compute_infer": _duration(*entry.compute),
                                **{k: _duration() for k in UNMEASURED},
                                "cache_hit": _duration(*entry.cache[HIT]),
                                "cache_miss": _duration(*entry.cache[MISS])},
            "batch_stats": _batch_stats(entry.buckets),
            "memory_usage": [],
        })
    return {"model_stats": stats}
