"""Reading the service's Prometheus histograms from /metrics, for the bench scripts that report a server-side time
(bench/priority_wait.py, bench/cache_hit_latency.py), and the sample quantile they print beside it."""

from __future__ import annotations

import http.client

from prometheus_client.parser import text_string_to_metric_families

from service.client.processes import LOOPBACK

Buckets = list[tuple[float, float]]  # (bucket's upper bound, cumulative count), ascending


def histogram_buckets(port: int, name: str, by: str, **labels: str) -> dict[str, Buckets]:
    """The histogram `name` of the service on `port`, its samples whose labels include `labels`, summed per value of
    the label `by` (e.g. priority -> buckets)."""
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=30)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    summed: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket" and all(sample.labels.get(k) == v for k, v in labels.items()):
                bounds = summed.setdefault(sample.labels[by], {})
                bound = float(sample.labels["le"])
                bounds[bound] = bounds.get(bound, 0.0) + sample.value
    return {key: sorted(bounds.items()) for key, bounds in summed.items()}


def bucket_quantile(buckets: Buckets, q: float) -> float:
    """The upper bound of the histogram bucket that holds the q-quantile."""
    total = buckets[-1][1]
    return next(bound for bound, count in buckets if count >= q * total)


def sample_quantile(values: list[float], q: float) -> float:
    """The q-quantile of `values`: the value at index floor(q x n) of the sorted sample (its last for q = 1)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
