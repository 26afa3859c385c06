"""A running server's Prometheus metrics as the tests read them: every sample of `/metrics`, and a sum over the
samples of one name whose labels match."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(client: httpx.Client) -> list:
    """Every sample of `/metrics`."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    return [s for family in text_string_to_metric_families(response.text) for s in family.samples]


def metric(samples: list, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 when there is none)."""
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
