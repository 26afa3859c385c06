"""The parts of bench/bench_http.py (which documents the benchmark and runs it):

- repository.py: the model repository it serves, release sizes with random weights, built once;
- servers.py: the servers, started by the shared launcher (service.client.launcher), and what is read from them (CPU
  seconds from /proc, mean batch sizes from /metrics);
- load.py: the load generator: closed-loop async clients, one streamed or JSON request -> a Result;
- cases.py: the workloads (request bodies, encoded once) and the cases: (endpoint, concurrency) on a server,
  measured over interleaved rounds;
- constrained.py: the constrained GPT case (a JSON schema per request, the same or a new one) and its ratios;
- prefix.py, lmeval.py, speculation.py: issue 55's cases (prefix caching hit / miss and on / off, an lm-eval
  multiple-choice run replayed with the cache on / off, n-gram speculation on / off), with ab.py: their GPT-only
  servers, the counters they read from /metrics, their ratios with goals and the text windows of their prompts;
- report.py: the per-round lines, the tables, the goals and the environment recorded in the JSON report.
"""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
