"""The benchmark's servers, each a subprocess started by the shared launcher (service.client.launcher: clean environment,
free port, ready at /health/ready, always stopped): the service and the baseline, plus what is read from them (CPU
seconds, batch sizes, token ids); and the rule that one server runs at a time (`run_alone`), the peers' included
(llama-server, the CTranslate2 worker: anything with a `name`, a `pid` and `send_signal`)."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterable
from pathlib import Path

from service.client.launcher import ServiceProcess
from service.client.processes import LOOPBACK, free_port, signal_group

from . import PROJECT_ROOT

BASELINE_SCRIPT = PROJECT_ROOT / "bench" / "baseline_server.py"
READY_TIMEOUT_S = 300.0
TOKENIZE_TIMEOUT_S = 30.0


def _stat_cpu_seconds(path: Path) -> float:
    fields = path.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> tuple[float, float] | None:
    """(all threads, main thread) utime + stime of a process, from /proc; None where there is no /proc. The main
    thread of the service and of uvicorn is the event loop's."""
    try:
        return _stat_cpu_seconds(Path(f"/proc/{pid}/stat")), _stat_cpu_seconds(Path(f"/proc/{pid}/task/{pid}/stat"))
    except (OSError, ValueError, IndexError):
        return None



def batch_stats(url: str) -> dict[str, tuple[float, float]]:
    """The service's `tserve_batch_size` histogram per model: (sum, count); {} when there is none."""
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    stats: dict[str, list[float]] = {}
    for line in text.splitlines():
        for suffix, slot in (("_sum{", 0), ("_count{", 1)):
            if line.startswith("tserve_batch_size" + suffix):
                model = line.split('model="', 1)[1].split('"', 1)[0]
                stats.setdefault(model, [0.0, 0.0])[slot] += float(line.rsplit(" ", 1)[1])
    return {model: (a, b) for model, (a, b) in stats.items()}


def metric_totals(url: str, names: Iterable[str]) -> dict[str, float]:
    """The service's counters `names` (without `_total`), each summed over its labels (models, versions): 0.0 for
    one it does not export (yet), {} when /metrics cannot be read."""
    import httpx

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith("_total") and name[: -len("_total")] in totals:
            totals[name[: -len("_total")]] += float(line.rsplit(" ", 1)[1])
    return totals


def model_variant(url: str, model: str) -> dict:
    """The `variant` `/v1/models` reports for `model` (weights, prefix_cache, prefix_caching, ...); {} when none."""
    import httpx

    try:
        listing = httpx.get(f"{url}/v1/models", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return next((entry.get("variant") or {} for entry in listing.get("data", []) if entry.get("id") == model), {})


def tokenize(server: ServiceProcess, model: str, texts: list[str]) -> list[list[int]]:
    """The token ids the service feeds `model` for each text (its `/tokenize`: the GPT's prompt as it is, a
    translator's source with its end-of-source token), so that a peer given ids gets the service's very input."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=TOKENIZE_TIMEOUT_S) as client:
        ids = []
        for text in texts:
            response = client.post("/tokenize", json={"model": model, "prompt": text})
            response.raise_for_status()
            ids.append(response.json()["tokens"])
    return ids


def run_alone(server, servers: Iterable) -> None:
    """Let `server` run (SIGCONT) and stop every other one (SIGSTOP, to its process group when it leads one): while
    a case is measured no other server's threads take a core (the peers' spin a while after their work)."""
    for other in servers:
        if other is not server:
            signal_group(other, signal.SIGSTOP)
    signal_group(server, signal.SIGCONT)


def resume(server) -> None:
    """SIGCONT: before a server is stopped for good (a stopped process acts on SIGTERM only once continued)."""
    signal_group(server, signal.SIGCONT)


def server_record(server) -> dict:
    """What the JSON report records of a server: its name, command, readiness time, log and settings."""
    environment = getattr(server, "environment", None) or {}
    log = getattr(server, "log_path", None)
    return {"name": server.name, "command": getattr(server, "command", None),
            "ready_s": getattr(server, "ready_seconds", None), "log": None if log is None else str(log),
            "env": {k: v for k, v in environment.items() if k.startswith(("TSERVE_", "OMP_"))}}


def service_server(args, name: str, repository: Path, vit_batching: bool,
                   models: list[str] | None = None, env: dict[str, str] | None = None) -> ServiceProcess:
    """`python -m service` on the repository, on --device (default CPU), the benchmark's threads, its gRPC port on;
    --server-env over these settings, and `env` over --server-env (a case's own A/B setting)."""
    knobs = {"device": getattr(args, "device", "cpu"), "intra_op_threads": args.threads,
             "ort_spin": "true" if args.spin else "false",
             "vit_batching": "true" if vit_batching else "false", "drain_timeout_s": 5,
             "max_new_tokens": max(256, args.max_new_tokens), "grpc_port": free_port()}
    if models:
        knobs["models"] = json.dumps(models)
    return ServiceProcess(name, repository, env={**args.server_env, **(env or {})},
                          log_path=args.workdir / "logs" / f"{name}.log",
                          ready_timeout=READY_TIMEOUT_S, die_with_parent=True, **knobs)


def grpc_target(server: ServiceProcess) -> str:
    """host:port of a service's gRPC port (its TSERVE_GRPC_PORT knob)."""
    return f"{LOOPBACK}:{server.knobs['TSERVE_GRPC_PORT']}"


def baseline_server(args, architecture: dict) -> ServiceProcess:
    """bench/baseline_server.py, the served GPT's size, the same threads."""

    def command(port: int) -> list[str]:
        argv = [sys.executable, str(BASELINE_SCRIPT), "--port", str(port), "--threads", str(args.threads),
                "--max-new-tokens", str(max(256, args.max_new_tokens))]
        for option in ("vocab-size", "context-length", "d-model", "n-layers", "n-heads", "d-ff"):
            key = option.replace("-", "_")
            if key in architecture:
                argv += [f"--{option}", str(architecture[key])]
        return argv + (["--spin"] if args.spin else [])

    env = {"OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "ACTIVE" if args.spin else "PASSIVE"}
    return ServiceProcess("baseline", command=command, env=env, log_path=args.workdir / "logs" / "baseline.log",
                          ready_timeout=READY_TIMEOUT_S, die_with_parent=True)
