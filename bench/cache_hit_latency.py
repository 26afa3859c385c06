"""Issue 57's response-cache goal: the server-side time of a hit, p99 (goal < 1 ms), on the release models served as
`make serve` serves them with the response cache on, local (default) or in Redis (`--redis URL`).

    .venv/bin/python bench/cache_hit_latency.py [--requests 2000] [--redis redis://127.0.0.1:6379/0]

A beam-4 translation and a greedy 64-token generation are each sent once (a miss that
stores it), then `--requests` times again, one at a time. Printed, with the CPU: the server's own lookup time for the
hits (`tserve_response_cache_lookup_seconds{result="hit"}`: finding the entry and rebuilding the answer, p50 / p99 as
its histogram's bucket bounds) and the client's round trip of a hit over loopback HTTP (p50 / p99: the lookup plus
the HTTP server, routing, validation and the JSON answer), against the same request's miss.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpuinfo import describe  # noqa: E402
from bench.histograms import bucket_quantile, histogram_buckets, sample_quantile  # noqa: E402
from service.client.launcher import ServiceProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LOOKUP = "tserve_response_cache_lookup_seconds"
REQUESTS = {
    "translation": ("/v1/translate", {"text": "Ein Mann fährt mit dem Fahrrad durch die Stadt.", "num_beams": 4}),
    "gpt": ("/v1/generate", {"prompt": "ROMEO:\n", "max_new_tokens": 64, "temperature": 0}),
}


def post(port: int, path: str, body: dict) -> float:
    """Seconds of one request's round trip (200 expected)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    started = time.perf_counter()
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    response.read()
    elapsed = time.perf_counter() - started
    connection.close()
    if response.status != 200:
        raise RuntimeError(f"{path}: {response.status}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="hits per request kind")
    parser.add_argument("--redis", default="", help="TSERVE_RESPONSE_CACHE_REDIS_URL (default: the local cache)")
    args = parser.parse_args()
    print(describe(), flush=True)
    knobs = {"models": "translation,gpt", "response_cache": "all", "prefix_cache": "false"}
    if args.redis:
        knobs["response_cache_redis_url"] = args.redis
    server = ServiceProcess("cache", ROOT / "model_repository", **knobs)
    server.start()
    try:
        for name, (path, body) in REQUESTS.items():
            miss = post(server.port, path, body)
            hits = [post(server.port, path, body) for _ in range(args.requests)]
            print(f"{name}: miss {miss * 1e3:.1f} ms; hit round trip p50 "
                  f"{sample_quantile(hits, 0.5) * 1e3:.2f} ms, p99 {sample_quantile(hits, 0.99) * 1e3:.2f} ms "
                  f"({len(hits)} hits)", flush=True)
        buckets = histogram_buckets(server.port, LOOKUP, "result")["hit"]  # summed over the models
    finally:
        server.stop()
    print(f"server-side lookup of a hit ({'Redis' if args.redis else 'local'}): p50 <= "
          f"{bucket_quantile(buckets, 0.5) * 1e3:g} ms, p99 <= {bucket_quantile(buckets, 0.99) * 1e3:g} ms "
          f"({buckets[-1][1]:.0f} hits; histogram bucket bounds)   (issue 57 goal: p99 < 1 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
