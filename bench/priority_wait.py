"""Issue 57's priority goal: under a sustained overload of background requests (priority 2), how long urgent ones
(priority 0) wait, against a decoding step's time, on the release GPT served as `make serve` serves it.

    .venv/bin/python bench/priority_wait.py [--seconds 60] [--overload 3]

A server with one decoding worker of `--rows` rows and a queue of `--queue` requests; `--overload` x rows
background clients stream greedy requests of `--tokens` tokens back to back (the queue stays full: the surplus is
refused with 429s and retried after a pause), while one client sends an urgent request of the same shape every
`--every` seconds. Printed, with the CPU: the urgent and background requests' time to first token (p50 / p95, the
queue wait plus their prompt pass and first step), the step time (the background streams' median gap between
tokens), and the goal's ratio: urgent TTFT p95 / step time (issue 57: the queue wait's p95 under 2 steps; TTFT is
an upper bound of it). One run, one machine; nothing else should run beside it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpuinfo import describe  # noqa: E402
from bench.histograms import bucket_quantile, histogram_buckets, sample_quantile  # noqa: E402
from service.client.launcher import ServiceProcess  # noqa: E402
from service.client.sse import SSEParser  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "ROMEO:\nWhat light through yonder window breaks? It is the east, and Juliet is the sun."
BACKGROUND, URGENT = 2, 0
REFUSED_PAUSE_S = 0.5  # a background client refused with a 429 tries again after this
WAIT_METRIC = "tserve_priority_queue_wait_seconds"


def stream_once(port: int, priority: int, tokens: int) -> tuple[int, float | None, list[float]]:
    """One streamed greedy request: (status, seconds to its first token, gaps between its tokens)."""
    body = json.dumps({"prompt": PROMPT, "max_new_tokens": tokens, "min_new_tokens": tokens, "temperature": 0,
                       "stream": True, "priority": priority})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    started = time.perf_counter()
    connection.request("POST", "/v1/generate", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        response.read()
        connection.close()
        return response.status, None, []
    parser, times = SSEParser(), []
    for line in response:
        if parser.feed_line(line):
            times.append(time.perf_counter())
    connection.close()
    first = times[0] - started if times else None
    return 200, first, [b - a for a, b in zip(times, times[1:])]


def run(args) -> dict:
    server = ServiceProcess("priority", ROOT / "model_repository", models="gpt", decoding_workers=1,
                            gpt_max_batch_rows=args.rows, max_queue_size=args.queue, default_priority="1",
                            prefix_cache="false")
    server.start()
    stop = threading.Event()
    results = {"background": [], "urgent": [], "gaps": [], "refused": 0}
    lock = threading.Lock()

    def background():
        while not stop.is_set():
            status, first, gaps = stream_once(server.port, BACKGROUND, args.tokens)
            with lock:
                if status == 429:
                    results["refused"] += 1
                elif first is not None:
                    results["background"].append(first)
                    results["gaps"].extend(gaps)
            if status == 429:
                time.sleep(REFUSED_PAUSE_S)

    try:
        clients = [threading.Thread(target=background, daemon=True) for _ in range(args.overload * args.rows)]
        for client in clients:
            client.start()
        time.sleep(args.warmup)
        with lock:
            results["background"].clear()
            results["gaps"].clear()
        ends = time.monotonic() + args.seconds
        while time.monotonic() < ends:
            status, first, _ = stream_once(server.port, URGENT, args.tokens)
            if first is not None:
                results["urgent"].append(first)
            time.sleep(args.every)
        results["waits"] = histogram_buckets(server.port, WAIT_METRIC, "priority")
        stop.set()
        for client in clients:
            client.join(timeout=120)
    finally:
        server.stop()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--overload", type=int, default=3, help="background clients per batch row")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--queue", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--every", type=float, default=0.5, help="seconds between urgent requests")
    args = parser.parse_args()
    print(describe())
    results = run(args)
    step = statistics.median(results["gaps"])
    urgent, background = results["urgent"], results["background"]
    print(f"rows {args.rows}, queue {args.queue}, {args.overload * args.rows} background clients, "
          f"{args.tokens} tokens each; {len(urgent)} urgent and {len(background)} background requests timed, "
          f"{results['refused']} background 429s")
    print(f"step (median gap between a background stream's tokens): {step * 1e3:.1f} ms")
    for name, values in (("urgent (priority 0)", urgent), ("background (priority 2)", background)):
        print(f"{name}: time to first token p50 {sample_quantile(values, 0.5) * 1e3:.1f} ms, "
              f"p95 {sample_quantile(values, 0.95) * 1e3:.1f} ms")
    for level, buckets in sorted(results["waits"].items()):
        print(f"server queue wait, priority {level}: p95 <= {bucket_quantile(buckets, 0.95) * 1e3:g} ms "
              f"({buckets[-1][1]:.0f} requests; the histogram's bucket bound)")
    ratio = sample_quantile(urgent, 0.95) / step
    print(f"urgent TTFT p95 / step = {ratio:.2f} (goal: queue wait p95 < 2 steps; TTFT bounds it from above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
