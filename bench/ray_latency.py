"""Issue 58's Ray goal: p95 latency at a fixed moderate load on the Ray cluster, over the same load on one `make serve`
process; the goal is at most 2.0.

    .venv/bin/python bench/ray_latency.py [--rate 20] [--seconds 60] [--repository model_repository]

Needs .venv-ray (`make ray-venv`). The same open-loop load on each, one after the other: `--rate` requests a second
at even intervals (the mix of deploy/ray/load.py: a greedy translation, a streamed generation, a one-image
classification, in turn), for `--seconds` after `--warmup` seconds that are not counted; each request timed from its
send to its last byte, retried once as nginx would. First one `make serve` process (`python -m service` on the
repository, every setting at its default: all cores); then the Ray cluster of tests/deploy/test_ray_cluster.py (a
head and two workers, 1 CPU each) running deploy/ray/serve_config.yaml with `--min-replicas` replicas (1 ONNX
Runtime thread each, the config's value). Printed, with the CPU: p50/p95 per system and per request kind, the
failures, and the ratio of the p95s. One run, one machine; nothing else should run beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.cpuinfo import describe  # noqa: E402
from deploy.ray.load import REQUEST_TIMEOUT_S, Outcome, mix, send_retrying  # noqa: E402
from deploy.ray.local_cluster import LocalRayCluster  # noqa: E402
from models.data import load_fashion_mnist  # noqa: E402
from service.client.launcher import ServiceProcess  # noqa: E402
from tests.support.images import png_bytes  # noqa: E402

GOAL = 2.0
# A moderate load: about a seventh of what one `make serve` process takes of a similar mix on this 2-core machine
# (~140 requests/s, docs/operations.md's capacity plan), so that latency is the requests' own, not a queue's.
RATE = 20.0
SENDERS = 32  # threads that send: many more than the requests in flight at a moderate rate, so none waits for one
PERCENTILES = (50, 95)
FIXTURE_DATA = ROOT / "tests" / "fixtures" / "data"  # one Fashion-MNIST test image, as the test sends


def percentile(values: list[float], p: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1] if len(values) > 1 else values[0]


def open_loop(url: str, png: bytes, rate: float, warmup_s: float, seconds: float) -> list[Outcome]:
    """`rate` requests a second at even intervals for warmup + seconds; the outcomes after the warm-up."""
    requests, local = mix(png), threading.local()

    def one(index: int) -> Outcome:
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S, trust_env=False)
        return send_retrying(local.client, requests[index % len(requests)])

    start, total = time.monotonic(), int(rate * (warmup_s + seconds))
    with ThreadPoolExecutor(SENDERS) as pool:
        futures = []
        for index in range(total):
            time.sleep(max(0.0, start + index / rate - time.monotonic()))
            futures.append(pool.submit(one, index))
        outcomes = [future.result() for future in futures]
    return [o for o in outcomes if o.start >= start + warmup_s]


def summary(name: str, outcomes: list[Outcome]) -> float:
    """Prints p50/p95 overall and per request kind, and the failures; returns the overall p95 (seconds)."""
    latencies = [o.end - o.start for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    line = "  ".join(f"p{p} {percentile(latencies, p) * 1000:.1f} ms" for p in PERCENTILES)
    print(f"{name}: {len(outcomes)} requests, {len(failed)} failed, {sum(o.tries > 1 for o in outcomes)} retried; "
          f"{line}")
    for kind in dict.fromkeys(o.name for o in outcomes):
        values = [o.end - o.start for o in outcomes if o.ok and o.name == kind]
        print(f"    {kind:16s} " + "  ".join(f"p{p} {percentile(values, p) * 1000:.1f} ms" for p in PERCENTILES))
    for outcome in failed[:5]:
        print(f"    failed: {outcome}")
    return percentile(latencies, 95)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=RATE, help="requests per second")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--min-replicas", type=int, default=2, help="the Ray application's min_replicas")
    options = parser.parse_args()
    print(describe())
    print(f"load: {options.rate:g} requests/s for {options.seconds:g} s (after {options.warmup:g} s of warm-up), "
          f"models: {options.repository}")
    images, _ = load_fashion_mnist(FIXTURE_DATA, "test")
    png = png_bytes(images[0])
    with ServiceProcess("make-serve", options.repository, log_level="WARNING") as server:
        single = summary("one `make serve` process", open_loop(server.url, png, options.rate, options.warmup,
                                                                 options.seconds))
    with tempfile.TemporaryDirectory() as folder, LocalRayCluster(
            options.repository, Path(folder) / "driver.log",
            app_args={"min_replicas": options.min_replicas}) as cluster:
        replicas = cluster.replicas()["replicas"]
        print(f"Ray cluster: replicas on {sorted(r['node'] for r in replicas)}")
        ray = summary("Ray cluster", open_loop(cluster.url, png, options.rate, options.warmup, options.seconds))
        print(f"Ray cluster after the load: replicas on {sorted(r['node'] for r in cluster.replicas()['replicas'])}")
    ratio = ray / single
    print(f"p95 ratio, Ray cluster / one make serve process: {ratio:.2f} (goal <= {GOAL:g}: "
          f"{'met' if ratio <= GOAL else 'NOT met'})")


if __name__ == "__main__":
    main()
