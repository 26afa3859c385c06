"""HTTP benchmark: throughput and client-side p50/p95/p99 latency of the running service, per endpoint, at fixed
concurrencies, plus the baseline a user would otherwise write (transformers `generate()` behind FastAPI).

What it measures (closed loop: N client tasks, each sends its next request when its previous one has finished):
- `POST /v1/generate`, streamed (SSE), greedy (`temperature: 0`), `max_new_tokens` 64, prompts of 32 characters of
  tinyshakespeare's validation text, at 1 and 32 concurrent streams -> tokens/s (tokens counted from the SSE
  events, checked against the final event's `usage`), time to first token p50/p95/p99, request latency;
- `POST /v1/translate`, beam 4, one Multi30k validation sentence per request, 16 concurrent -> sentences/s;
- `POST /v1/classify`, one Fashion-MNIST test image per request (PNG, multipart `files`), 64 concurrent ->
  images/s, on two servers: dynamic batching on and off (TSERVE_VIT_BATCHING=true / false);
- the baseline, `bench/baseline_server.py`: `POST /generate` calling `GPT2LMHeadModel.generate()` per request in
  FastAPI's threadpool, same prompts and token count, not streamed, at 1 and 32 concurrent clients -> tokens/s.
Goals, printed as PASS/MISS: ViT images/s with batching >= 3x without; GPT tokens/s at 32 streams >= 5x the
baseline's at 32 clients, and >= 4x this service's at 1 stream. A case with any error voids its goal's PASS.
Per case it also reports the mean batch (rows per decoding step, images per ONNX Runtime call; from /metrics),
the cores used by the server process, its main (event-loop) thread and the client, and the work per server
CPU-second: a diagnostic of efficiency with the machine's CPU share factored out (the goals use throughput).

Models: unless --repository names a model repository (e.g. of trained models), the script builds one, once, into
.cache/bench_http/repository-<hash> with the project's exporter (`export.onnx_export.EXPORTERS`): the release
presets' sizes (GPT d=256, 4 layers, 4 heads, context 256, byte vocabulary 257; translation d=256, 3+3 layers,
vocabulary 8,000; ViT patch 7, d=128, 6 layers, 28x28 grey) with RANDOM weights (seed 0), the byte tokenizer for
GPT and a BPE trained on 5,000 Multi30k training pairs for translation. Random weights cost the same as trained
ones; only the output lengths differ, and those are pinned (below). Data: --data-dir, $TSERVE_DATA_DIR, else
../shared/data, else ./data.

Fairness:
- Every server is a subprocess on a free port, started from a clean environment (no inherited TSERVE_*, no .env:
  only what this script sets, plus --server-env), measured after /health/ready and a warm-up (--warmup requests
  per case; default one per client). All servers stay up for the whole run (an idle one costs next to nothing)
  and the cases run round-robin, --rounds times, each for duration/rounds (like bench_engine.py's interleaved
  repeats): a background load that drifts over time hits every case alike. One case runs at a time.
- Same thread settings for all: --threads ONNX Runtime intra-op threads (TSERVE_INTRA_OP_THREADS, inter-op 1) and
  torch threads for the baseline (plus OMP_NUM_THREADS); idle threads sleep (TSERVE_ORT_SPIN=false;
  OMP_WAIT_POLICY=PASSIVE) unless --spin. Device CPU (TSERVE_DEVICE=cpu).
- Same work: greedy is deterministic, so the GPT prompts are screened once on the service and only those that run
  to `max_new_tokens` without EOS are used, by the service and the baseline alike (natural decoding, no
  min_new_tokens on the service side); the baseline gets `min_new_tokens == max_new_tokens`, so it generates exactly as
  many tokens. Translation with random weights is pinned to `min_new_tokens == max_new_tokens`
  (--translation-tokens, 30 like bench_engine.py); with --repository it decodes naturally unless that is given.
- One client for all: httpx on one event loop (uvloop when installed), one AsyncClient (one keep-alive
  connection) per concurrent task, request bodies encoded beforehand. (One AsyncClient shared by 64 tasks costs
  ~5 ms of client CPU per request in httpcore's pool bookkeeping, measured here, against ~0.8 ms this way.)
  Latency is client-side: from sending the request to the end of the response ([DONE] for streams).
  Throughput = work of the successful timed requests / the rounds' wall time (first start to last end).
- Every non-2xx response, transport error, SSE error event or stream without [DONE] is an error: reported per
  kind, never counted as work.
- The machine is shared: compare ratios from one run, not absolute numbers across runs. Run it niced.

Run (main venv), e.g. as `make bench-http`:
    nice -n 10 .venv/bin/python bench/bench_http.py --quick      # smoke run, ~1-2 minutes once models are built
    nice -n 10 .venv/bin/python bench/bench_http.py              # full run (24 s per case), reports/bench_http.json
Options: --duration S | --requests N (per case, over all rounds), --rounds N, --warmup N, --threads N, --spin,
--repository DIR, --data-dir DIR, --cases gpt,translation,vit,baseline, --max-new-tokens N,
--gpt-concurrency 1,32, --baseline-concurrency 1,32, --translation-concurrency 16, --vit-concurrency 64,
--num-beams N, --translation-tokens N, --server-env KEY=VALUE, --out PATH, --workdir PATH.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import asyncio
import contextlib
import hashlib
import io
import itertools
import json
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PROJECT_ROOT = Path(__file__).resolve().parents[1]
if str(PROJECT_ROOT) not in sys.path:
    sys.path.insert(0, str(PROJECT_ROOT))

BASELINE_SCRIPT = PROJECT_ROOT / "bench" / "baseline_server.py"
TRANSLATION_TOKENIZER_PAIRS = 5000  # Multi30k training pairs the benchmark's BPE is trained on
JSON_HEADERS = {"content-type": "application/json"}
BOUNDARY = "bench-http-7d1f3a"

GOALS = (  # (key, description, numerator case, denominator case, threshold)
    ("vit_batching", "ViT images/s, dynamic batching on / off", "vit batching=on", "vit batching=off", 3.0),
    ("gpt_vs_baseline", "GPT tokens/s, ours 32 streams / baseline 32 clients", "gpt c=32", "baseline c=32", 5.0),
    ("gpt_scaling", "GPT tokens/s, ours 32 streams / ours 1 stream", "gpt c=32", "gpt c=1", 4.0),
)


# ----------------------------------------------------------------------------------------------------------------
# The model repository: release-size models with random weights, built once


def _source_digest(extra: dict) -> str:
    sources = sorted(PROJECT_ROOT.glob("models/*.py")) + sorted(PROJECT_ROOT.glob("export/*.py"))
    digest = hashlib.sha1(json.dumps(extra, sort_keys=True).encode())
    for path in sources:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def build_repository(workdir: Path, data_dir: Path, threads: int) -> Path:
    """A repository with gpt/1, translation/1 and vit/1 (release sizes, random weights), built once per source
    digest into workdir/repository-<digest>; built in a staging folder and renamed into place when complete."""
    from models.config import get_preset

    presets = {kind: get_preset(kind, "release")[0] for kind in ("gpt", "translation", "vit")}
    key = _source_digest({"presets": {k: repr(v) for k, v in presets.items()}, "seed": 0,
                          "tokenizer_pairs": TRANSLATION_TOKENIZER_PAIRS})
    final = workdir / f"repository-{key}"
    if final.is_dir():
        return final
    print(f"building the random-weight model repository in {final} (once) ...", flush=True)
    started = time.perf_counter()
    import dataclasses

    import torch

    from export.onnx_export import EXPORTERS, OPSET
    from models import data
    from models.gpt import GPT
    from models.tokenization import build_byte_tokenizer, train_translation_tokenizer
    from models.transformer import EncoderDecoderTransformer
    from models.vit import ViT
    from service.repository import CONFIG_FILE, TOKENIZER_FILE

    torch.set_num_threads(threads)
    builders = {"gpt": GPT, "translation": EncoderDecoderTransformer, "vit": ViT}
    workdir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".repository-", dir=workdir))
    try:
        for kind, preset in presets.items():
            folder = staging / kind / "1"
            folder.mkdir(parents=True)
            config = dataclasses.replace(preset, dropout=0.0)
            torch.manual_seed(0)
            described = EXPORTERS[kind](builders[kind](config).eval(), config, folder)
            described.update({"name": kind, "version": 1, "opset": OPSET,
                              "note": "random weights, built by bench/bench_http.py"})
            if kind == "gpt":
                build_byte_tokenizer().save(str(folder / TOKENIZER_FILE))
            elif kind == "translation":
                pairs = data.load_multi30k(data_dir, "train")[:TRANSLATION_TOKENIZER_PAIRS]
                tokenizer = train_translation_tokenizer([s for pair in pairs for s in pair], config.vocab_size)
                tokenizer.save(str(folder / TOKENIZER_FILE))
            if kind != "vit":
                described["tokenizer"] = TOKENIZER_FILE
            (folder / CONFIG_FILE).write_text(json.dumps(described, indent=2))
            print(f"  exported {kind} ({sum(p.stat().st_size for p in folder.iterdir()) / 1e6:.1f} MB)", flush=True)
        staging.rename(final)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    print(f"  built in {time.perf_counter() - started:.0f} s", flush=True)
    return final


# ----------------------------------------------------------------------------------------------------------------
# Workloads: request bodies, encoded once


@dataclass
class Workload:
    path: str
    bodies: list[bytes]
    headers: dict[str, str]
    stream: bool = False
    unit: str = "requests/s"
    work: Callable[[dict], float] = lambda payload: 1.0  # work units in a successful JSON response


def gpt_prompts(data_dir: Path, count: int, chars: int) -> list[str]:
    """`count` prompts of `chars` characters, each starting at a line start, spread over the validation text."""
    from models.data import load_shakespeare

    _, val = load_shakespeare(data_dir)
    prompts = []
    for start in np.linspace(0, len(val) - 4 * chars, count).astype(int):
        line = val.find("\n", start)
        start = line + 1 if 0 <= line < len(val) - 2 * chars else start
        prompts.append(val[start : start + chars])
    return prompts


def gpt_workload(prompts: list[str], max_new_tokens: int) -> Workload:
    bodies = [json.dumps({"prompt": p, "max_new_tokens": max_new_tokens, "temperature": 0, "stream": True}).encode()
              for p in prompts]
    return Workload("/v1/generate", bodies, JSON_HEADERS, stream=True, unit="tokens/s")


def baseline_workload(prompts: list[str], max_new_tokens: int) -> Workload:
    bodies = [json.dumps({"prompt": p, "max_new_tokens": max_new_tokens}).encode() for p in prompts]
    return Workload("/generate", bodies, JSON_HEADERS, unit="tokens/s",
                    work=lambda payload: float(payload["completion_tokens"]))


def translation_workload(data_dir: Path, count: int, num_beams: int, new_tokens: int | None) -> Workload:
    from models.data import load_multi30k

    sentences = [de for de, _ in load_multi30k(data_dir, "val")][:count]
    extra = {} if new_tokens is None else {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    bodies = [json.dumps({"text": s, "num_beams": num_beams, **extra}).encode() for s in sentences]

    def work(payload: dict) -> float:
        if not payload.get("translations") or not payload["translations"][0]:
            raise ValueError("no translation in the response")
        return float(len(payload["translations"]))

    return Workload("/v1/translate", bodies, JSON_HEADERS, unit="sentences/s", work=work)


def vit_workload(data_dir: Path, count: int) -> Workload:
    """One Fashion-MNIST test image per request, as a PNG in a multipart/form-data body (field `files`)."""
    from PIL import Image

    from models.data import load_fashion_mnist

    images, _ = load_fashion_mnist(data_dir, "test")
    bodies = []
    for i, pixels in enumerate(images[:count]):
        png = io.BytesIO()
        Image.fromarray(pixels, mode="L").save(png, format="PNG")
        bodies.append(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="files"; filename="test{i}.png"\r\n'
                      f"Content-Type: image/png\r\n\r\n".encode() + png.getvalue() + f"\r\n--{BOUNDARY}--\r\n".encode())

    def work(payload: dict) -> float:
        if not payload.get("predictions") or not payload["predictions"][0]:
            raise ValueError("no prediction in the response")
        return float(len(payload["predictions"]))

    return Workload("/v1/classify", bodies, {"content-type": f"multipart/form-data; boundary={BOUNDARY}"},
                    unit="images/s", work=work)


# ----------------------------------------------------------------------------------------------------------------
# Servers: subprocesses on free ports, ready when /health/ready says 200, always stopped


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the benchmark dies (Linux), so no server outlives it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the finally blocks still stop the servers
        pass


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


class Server:
    """A server subprocess; `with Server(...) as server:` starts it, waits until ready, and always stops it."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], port: int, log_path: Path,
                 ready_timeout: float = 300.0):
        self.name, self.command, self.env, self.port = name, command, env, port
        self.log_path, self.ready_timeout = log_path, ready_timeout
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen | None = None
        self.ready_seconds: float | None = None

    def __enter__(self) -> Server:
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        started = time.perf_counter()
        self.process = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, cwd=self.log_path.parent,
                                        preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        log.close()
        try:
            deadline = time.monotonic() + self.ready_timeout
            reason = "no answer"
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with code {self.process.returncode} before it was "
                                       f"ready; log {self.log_path}:\n{self.log_tail()}")
                try:
                    response = httpx.get(f"{self.url}/health/ready", timeout=2.0)
                    if response.status_code == 200:
                        self.ready_seconds = time.perf_counter() - started
                        return self
                    reason = f"{response.status_code} {response.text[:300]}"
                except httpx.HTTPError as error:
                    reason = type(error).__name__
                time.sleep(0.25)
            raise RuntimeError(f"{self.name} not ready after {self.ready_timeout:.0f} s ({reason}); "
                               f"log {self.log_path}:\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def cpu_seconds(self) -> tuple[float, float] | None:
        return process_cpu_seconds(self.process.pid) if self.process else None

    def batch_stats(self) -> dict[str, tuple[float, float]]:
        """The service's `tserve_batch_size` histogram per model: (sum, count); {} when there is none."""
        import httpx

        try:
            text = httpx.get(f"{self.url}/metrics", timeout=10).text
        except httpx.HTTPError:
            return {}
        stats: dict[str, list[float]] = {}
        for line in text.splitlines():
            for suffix, slot in (("_sum{", 0), ("_count{", 1)):
                if line.startswith("tserve_batch_size" + suffix):
                    model = line.split('model="', 1)[1].split('"', 1)[0]
                    stats.setdefault(model, [0.0, 0.0])[slot] += float(line.rsplit(" ", 1)[1])
        return {model: (a, b) for model, (a, b) in stats.items()}

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def clean_environment(extra: dict[str, str]) -> dict[str, str]:
    """The benchmark's environment without any TSERVE_* setting (a .env file is not read either: the servers run
    in the log folder), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TSERVE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def service_server(args, name: str, repository: Path, vit_batching: bool, models: list[str] | None = None) -> Server:
    port = free_port()
    env = {
        "TSERVE_REPOSITORY": str(repository.resolve()), "TSERVE_HOST": "127.0.0.1", "TSERVE_PORT": str(port),
        "TSERVE_DEVICE": "cpu", "TSERVE_INTRA_OP_THREADS": str(args.threads),
        "TSERVE_ORT_SPIN": "true" if args.spin else "false",
        "TSERVE_VIT_BATCHING": "true" if vit_batching else "false", "TSERVE_DRAIN_TIMEOUT_S": "5",
        "TSERVE_MAX_NEW_TOKENS": str(max(256, args.max_new_tokens)),
    }
    if models:
        env["TSERVE_MODELS"] = json.dumps(models)
    env.update(args.server_env)
    return Server(name, [sys.executable, "-m", "service"], clean_environment(env), port,
                  args.workdir / "logs" / f"{name}.log")


def baseline_server(args, architecture: dict) -> Server:
    port = free_port()
    command = [sys.executable, str(BASELINE_SCRIPT), "--port", str(port), "--threads", str(args.threads),
               "--max-new-tokens", str(max(256, args.max_new_tokens))]
    for option in ("vocab-size", "context-length", "d-model", "n-layers", "n-heads", "d-ff"):
        key = option.replace("-", "_")
        if key in architecture:
            command += [f"--{option}", str(architecture[key])]
    if args.spin:
        command.append("--spin")
    env = {"OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "ACTIVE" if args.spin else "PASSIVE"}
    return Server("baseline", command, clean_environment(env), port, args.workdir / "logs" / "baseline.log")


# ----------------------------------------------------------------------------------------------------------------
# The load generator


@dataclass
class Result:
    start: float
    end: float
    index: int = -1  # which body was sent
    work: float = 0.0
    ttft: float | None = None
    error: str | None = None
    finish_reason: str | None = None
    note: str | None = None

    @property
    def latency(self) -> float:
        return self.end - self.start


async def send_stream(client, workload: Workload, body: bytes) -> Result:
    """One streamed generate request: SSE events until [DONE]; work = generated tokens."""
    import httpx

    start = time.perf_counter()
    result = Result(start, start)
    tokens, usage, done = 0, None, False
    try:
        async with client.stream("POST", workload.path, content=body, headers=workload.headers) as response:
            if not 200 <= response.status_code < 300:
                await response.aread()
                result.error = f"HTTP {response.status_code}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        result.error = f"SSE error: {event['error'].get('type')}"
                    elif "finish_reason" in event:
                        result.finish_reason, usage = event["finish_reason"], event.get("usage")
                    else:
                        if result.ttft is None:
                            result.ttft = time.perf_counter() - start
                        tokens += 1
    except (httpx.HTTPError, OSError, ValueError) as error:
        result.error = type(error).__name__
    result.end = time.perf_counter()
    if result.error is None and not done:
        result.error = "stream ended without [DONE]"
    if result.error is None:
        result.work = float(tokens)
        if usage is not None and usage.get("completion_tokens") != tokens:
            result.note = f"usage says {usage.get('completion_tokens')} tokens, {tokens} token events"
    return result


async def send_json(client, workload: Workload, body: bytes) -> Result:
    import httpx

    start = time.perf_counter()
    result = Result(start, start)
    try:
        response = await client.post(workload.path, content=body, headers=workload.headers)
        if not 200 <= response.status_code < 300:
            result.error = f"HTTP {response.status_code}"
        else:
            payload = response.json()
            result.work = workload.work(payload)
            result.finish_reason = payload.get("finish_reason") if isinstance(payload, dict) else None
    except (httpx.HTTPError, OSError, ValueError, KeyError, TypeError) as error:
        result.error = type(error).__name__
    result.end = time.perf_counter()
    return result


async def _load(base_url: str, workload: Workload, concurrency: int, *, requests: int | None, duration: float,
                offset: int, timeout: float) -> tuple[list[Result], float]:
    """Closed loop: `concurrency` tasks send requests back to back, cycling through the bodies, until `requests`
    have been sent (or `duration` seconds have passed); returns the results and the client's CPU seconds.

    Each task has its own AsyncClient (one keep-alive connection): one client shared by 64 tasks costs ~5 ms of
    client CPU per request in httpcore's pool bookkeeping (measured here), against ~0.7 ms with one per task."""
    import httpx

    send: Callable[..., Awaitable[Result]] = send_stream if workload.stream else send_json
    results: list[Result] = []
    counter = itertools.count()
    clients = [httpx.AsyncClient(base_url=base_url, timeout=timeout,
                                 limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
               for _ in range(concurrency)]
    try:
        cpu = time.process_time()
        stop_at = time.perf_counter() + duration

        async def worker(client) -> None:
            while True:
                i = next(counter)
                if (i >= requests) if requests is not None else (time.perf_counter() >= stop_at):
                    return
                body = (offset + i) % len(workload.bodies)
                result = await send(client, workload, workload.bodies[body])
                result.index = body
                results.append(result)

        await asyncio.gather(*(worker(client) for client in clients))
        cpu = time.process_time() - cpu
    finally:
        for client in clients:
            await client.aclose()
    return results, cpu


def run_async(coroutine):
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coroutine)
    except ImportError:
        return asyncio.run(coroutine)


def _percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    array = np.asarray(values) * scale
    return {"p50": float(np.percentile(array, 50)), "p95": float(np.percentile(array, 95)),
            "p99": float(np.percentile(array, 99)), "mean": float(array.mean())}


@dataclass
class Case:
    """One (endpoint, concurrency) measurement on one server, accumulated over the interleaved rounds."""

    name: str
    endpoint: str
    server: Server
    workload: Workload
    concurrency: int
    model: str | None = None  # the service's model whose mean batch size (from /metrics) is reported
    results: list[Result] = field(default_factory=list)
    wall: float = 0.0
    client_cpu: float = 0.0
    server_cpu: float | None = 0.0
    loop_cpu: float | None = 0.0
    batch_sum: float = 0.0
    batch_count: float = 0.0
    sent: int = 0  # requests sent so far (warm-up included): the next body to send
    warmup: int = 0
    load_averages: list = field(default_factory=list)

    def run_warmup(self, requests: int, timeout: float) -> None:
        self.warmup = requests
        if requests:
            run_async(_load(self.server.url, self.workload, self.concurrency, requests=requests, duration=0.0,
                            offset=self.sent, timeout=timeout))
            self.sent += requests

    def run_round(self, duration: float, requests: int | None, timeout: float) -> list[Result]:
        self.load_averages.append(os.getloadavg())
        batches = self.server.batch_stats() if self.model else {}
        cpu_before = self.server.cpu_seconds()
        results, client_cpu = run_async(_load(self.server.url, self.workload, self.concurrency, requests=requests,
                                              duration=duration, offset=self.sent, timeout=timeout))
        cpu_after = self.server.cpu_seconds()
        self.sent += len(results)
        self.results += results
        self.client_cpu += client_cpu
        if results:
            self.wall += max(r.end for r in results) - min(r.start for r in results)
        if cpu_before is None or cpu_after is None or self.server_cpu is None:
            self.server_cpu = self.loop_cpu = None
        else:
            self.server_cpu += cpu_after[0] - cpu_before[0]
            self.loop_cpu += cpu_after[1] - cpu_before[1]
        if self.model and self.model in batches:
            after = self.server.batch_stats().get(self.model, batches[self.model])
            self.batch_sum += after[0] - batches[self.model][0]
            self.batch_count += after[1] - batches[self.model][1]
        return results

    def summary(self) -> dict:
        results, wall = self.results, self.wall
        ok = [r for r in results if r.error is None]
        work = sum(r.work for r in ok)
        return {
            "case": self.name, "endpoint": self.endpoint, "server": self.server.name,
            "concurrency": self.concurrency, "unit": self.workload.unit,
            "requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
            "error_kinds": dict(Counter(r.error for r in results if r.error)),
            "wall_s": wall, "work": work, "throughput": work / wall if wall > 0 else 0.0,
            "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
            "work_per_request": work / len(ok) if ok else None,
            "latency_ms": _percentiles([r.latency for r in ok]),
            "ttft_ms": _percentiles([r.ttft for r in ok if r.ttft is not None]) if self.workload.stream else None,
            "finish_reasons": dict(Counter(r.finish_reason for r in ok if r.finish_reason)),
            "notes": sorted({r.note for r in results if r.note})[:5],
            "server_cpu_s": self.server_cpu, "server_main_thread_cpu_s": self.loop_cpu,
            "client_cpu_s": self.client_cpu,
            "work_per_server_cpu_s": work / self.server_cpu if self.server_cpu else None,
            "mean_batch": self.batch_sum / self.batch_count if self.batch_count else None,
            "warmup_requests": self.warmup, "load_averages": self.load_averages,
        }


def describe_round(case: Case, results: list[Result]) -> str:
    ok = [r for r in results if r.error is None]
    wall = (max(r.end for r in results) - min(r.start for r in results)) if results else 0.0
    errors = Counter(r.error for r in results if r.error)
    latency = _percentiles([r.latency for r in ok])
    return (f"{sum(r.work for r in ok) / wall if wall else 0.0:8.1f} {case.workload.unit:<12} "
            f"{len(ok):>5}/{len(results):<5} ok  p50 {_fmt(latency['p50'], '.0f')} ms"
            + (f"  errors {dict(errors)}" if errors else ""))


def screen_prompts(server: Server, prompts: list[str], max_new_tokens: int, args) -> tuple[list[str], dict]:
    """Greedy is deterministic: run every prompt once (this also warms the server up) and keep those that run to
    max_new_tokens without EOS, so that every measured request (ours and the baseline's) does the same work."""
    workload = gpt_workload(prompts, max_new_tokens)
    results, _ = run_async(_load(server.url, workload, min(32, len(prompts)), requests=len(prompts), duration=0.0,
                                 offset=0, timeout=args.timeout))
    good = {r.index for r in results if r.error is None and r.work == max_new_tokens}
    kept = [p for i, p in enumerate(prompts) if i in good]
    info = {"candidates": len(prompts), "kept": len(kept),
            "finish_reasons": dict(Counter(r.finish_reason or r.error for r in results))}
    print(f"  GPT prompts: {len(kept)} of {len(prompts)} run to {max_new_tokens} tokens without EOS "
          f"({info['finish_reasons']})", flush=True)
    if len(kept) < max(4, len(prompts) // 8):
        print("  warning: too few prompts reach max_new_tokens; using all of them (work per request will vary)",
              flush=True)
        kept = prompts
    return kept, info


# ----------------------------------------------------------------------------------------------------------------
# Report


def _fmt(value, pattern: str) -> str:
    return "n/a" if value is None else format(value, pattern)


def print_tables(cases: list[dict]) -> None:
    endpoints: dict[str, list[dict]] = {}
    for case in cases:
        endpoints.setdefault(case["endpoint"], []).append(case)
    header = (f"{'case':<18} {'conc':>4} {'requests':>8} {'errors':>6} {'throughput':>19} {'req/s':>8} "
              f"{'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'TTFT p50/p95':>13} {'batch':>6} "
              f"{'cpu srv/loop/cli':>17} {'work/srv-cpu-s':>14}")
    for endpoint, rows in endpoints.items():
        print(f"\n{endpoint}")
        print(header)
        print("-" * len(header))
        for r in rows:
            lat, ttft = r["latency_ms"], r["ttft_ms"]
            ttft_text = f"{_fmt(ttft['p50'], '.0f')}/{_fmt(ttft['p95'], '.0f')} ms" if ttft else "-"
            wall = r["wall_s"] or float("nan")
            cores = [r["server_cpu_s"], r["server_main_thread_cpu_s"], r["client_cpu_s"]]
            cpu = "/".join(_fmt(c and c / wall, ".2f") for c in cores)
            print(f"{r['case']:<18} {r['concurrency']:>4} {r['requests']:>8} {r['errors']:>6} "
                  f"{r['throughput']:>8.1f} {r['unit']:<10} {r['requests_per_s']:>8.1f} {_fmt(lat['p50'], '.1f'):>8} "
                  f"{_fmt(lat['p95'], '.1f'):>8} {_fmt(lat['p99'], '.1f'):>8} {ttft_text:>13} "
                  f"{_fmt(r['mean_batch'], '.1f'):>6} {cpu:>17} {_fmt(r['work_per_server_cpu_s'], '.1f'):>14}")
            if r["errors"]:
                print(f"{'':<18} errors: {r['error_kinds']}")
    print("\nbatch: mean rows per decoding step (text) or images per ONNX Runtime call (ViT), from the service's "
          "/metrics.\ncpu srv/loop/cli: cores used by the server process, by its main (event-loop) thread, and by "
          "the client.\nwork/srv-cpu-s: work per CPU-second of the server process (throughput with the CPU share "
          "factored out;\na diagnostic for a shared machine, not what the goals are judged on).")


def evaluate_goals(cases: list[dict]) -> list[dict]:
    by_case = {c["case"]: c for c in cases}
    goals = []
    for key, text, num, den, threshold in GOALS:
        a, b = by_case.get(num), by_case.get(den)
        ratio = a["throughput"] / b["throughput"] if a and b and b["throughput"] > 0 else None
        errors = (a["errors"] if a else 0) + (b["errors"] if b else 0)
        # strict: errors in either case void a PASS (the denominator's would inflate the ratio)
        status = "SKIPPED" if ratio is None else "MISS" if ratio < threshold or errors else "PASS"
        per_cpu = (a["work_per_server_cpu_s"] / b["work_per_server_cpu_s"]
                   if a and b and a["work_per_server_cpu_s"] and b["work_per_server_cpu_s"] else None)
        goals.append({"goal": key, "description": text, "ratio": ratio, "threshold": threshold, "status": status,
                      "numerator": num, "denominator": den, "errors_in_cases": errors,
                      "ratio_per_server_cpu_s": per_cpu})
    return goals


def print_goals(goals: list[dict]) -> None:
    print("\nGoals (ratios of throughputs measured in this run):")
    for g in goals:
        print(f"  {g['status']:<7} {g['description']}: {_fmt(g['ratio'], '.2f')}x (goal >= {g['threshold']:.0f}x)"
              f"   [per server CPU-second: {_fmt(g['ratio_per_server_cpu_s'], '.2f')}x]"
              + (f"  [errors in these cases: {g['errors_in_cases']}]" if g["errors_in_cases"] else ""))


def environment(args) -> dict:
    versions = {}
    for package in ("numpy", "onnxruntime", "torch", "transformers", "fastapi", "uvicorn", "httpx"):
        try:
            from importlib.metadata import version

            versions[package] = version(package)
        except Exception:  # noqa: BLE001 - not installed
            versions[package] = None
    return {"python": platform.python_version(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "threads": args.threads, "spin": args.spin, "load_average": os.getloadavg(),
            "niceness": os.nice(0), "executable": sys.executable, "versions": versions}


# ----------------------------------------------------------------------------------------------------------------
# Main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 s per case in 1 round, small warm-ups")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds of load per case, over all rounds (default 24; quick 4)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per case, over all rounds, instead of --duration")
    parser.add_argument("--rounds", type=int, default=None,
                        help="the cases run round-robin this many times, each for duration/rounds "
                             "(default 3; quick 1)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed requests per case (default: one per client; quick: at most 4)")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime / torch intra-op threads (default 2)")
    parser.add_argument("--spin", action="store_true", help="let idle threads busy-wait (only on idle machines)")
    parser.add_argument("--repository", type=Path, default=None,
                        help="serve this model repository instead of building random-weight models")
    parser.add_argument("--data-dir", type=Path, default=None, help="data folder (default $TSERVE_DATA_DIR, "
                        "else ../shared/data, else ./data)")
    parser.add_argument("--cases", default="gpt,translation,vit,baseline",
                        help="comma-separated subset of gpt,translation,vit,baseline")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="GPT tokens per request (default 64)")
    parser.add_argument("--prompt-chars", type=int, default=32, help="GPT prompt length in characters (default 32)")
    parser.add_argument("--prompts", type=int, default=64, help="GPT candidate prompts (default 64)")
    parser.add_argument("--gpt-concurrency", default="1,32")
    parser.add_argument("--baseline-concurrency", default="1,32")
    parser.add_argument("--translation-concurrency", default="16")
    parser.add_argument("--vit-concurrency", default="64")
    parser.add_argument("--num-beams", type=int, default=4, help="translation beam width (default 4)")
    parser.add_argument("--translation-tokens", type=int, default=None,
                        help="pin translations to exactly this many tokens (default 30 with random weights; "
                             "natural lengths with --repository); 0 = natural")
    parser.add_argument("--timeout", type=float, default=300.0, help="client timeout per request, seconds")
    parser.add_argument("--server-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the service (e.g. TSERVE_VIT_MAX_QUEUE_DELAY_MS=2); repeatable")
    parser.add_argument("--out", type=Path, default=Path("reports/bench_http.json"))
    parser.add_argument("--workdir", type=Path, default=Path(".cache/bench_http"),
                        help="built models and server logs (default .cache/bench_http)")
    args = parser.parse_args(argv)
    args.duration = args.duration if args.duration is not None else (4.0 if args.quick else 24.0)
    args.rounds = max(1, args.rounds or (1 if args.quick else 3))
    args.cases = [c for c in args.cases.split(",") if c]
    for case in args.cases:
        if case not in ("gpt", "translation", "vit", "baseline"):
            parser.error(f"unknown case {case!r}")
    for name in ("gpt_concurrency", "baseline_concurrency", "translation_concurrency", "vit_concurrency"):
        setattr(args, name, [int(c) for c in getattr(args, name).split(",") if c])
    try:
        args.server_env = dict(item.split("=", 1) for item in args.server_env)
    except ValueError:
        parser.error("--server-env takes KEY=VALUE")
    args.workdir = args.workdir.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # like Ctrl-C: stop the servers, report, exit 130
    from models.data import resolve_data_dir
    from service.repository import ModelRepository

    data_dir = resolve_data_dir(args.data_dir)
    os.environ["OMP_WAIT_POLICY"] = "ACTIVE" if args.spin else "PASSIVE"  # for the export, if it runs
    env = environment(args)
    amount = f"{args.requests} requests" if args.requests else f"{args.duration:g} s"
    print(f"threads={args.threads} spin={args.spin} per case: {amount} in {args.rounds} round(s); "
          f"load average={env['load_average']} nice={env['niceness']}", flush=True)
    random_weights = args.repository is None
    repository = build_repository(args.workdir, data_dir, args.threads) if random_weights else args.repository
    repo = ModelRepository(repository)
    kinds = {}
    for name in repo.model_names():
        kinds.setdefault(repo.get(name).kind, repo.get(name))
    print(f"repository: {repository} ({', '.join(f'{k}={v.name}:{v.version}' for k, v in kinds.items())})",
          flush=True)
    translation_tokens = args.translation_tokens if args.translation_tokens is not None else \
        (30 if random_weights else 0)

    skipped: dict[str, str] = {}
    for case, kind in (("gpt", "gpt"), ("translation", "translation"), ("vit", "vit"), ("baseline", "gpt")):
        if case in args.cases and kind not in kinds:
            skipped[case] = f"no {kind} model in {repository}"
    wanted = [c for c in args.cases if c not in skipped]
    max_new_tokens, prompts, gpt_architecture = args.max_new_tokens, [], {}
    if "gpt" in kinds:
        gpt_config = kinds["gpt"].config
        gpt_architecture = {**gpt_config["architecture"], "context_length": gpt_config["context_length"]}
        if args.prompt_chars + max_new_tokens > gpt_config["context_length"]:
            max_new_tokens = gpt_config["context_length"] - args.prompt_chars
            print(f"note: the GPT context is {gpt_config['context_length']}: max_new_tokens lowered to "
                  f"{max_new_tokens}", flush=True)
        prompts = gpt_prompts(data_dir, args.prompts, args.prompt_chars)

    cases: list[Case] = []
    servers: dict[str, Server] = {}
    screening: dict | None = None
    started = time.perf_counter()
    interrupted = False
    with contextlib.ExitStack() as stack:
        try:
            # Every server is started first and stays up (an idle server costs next to nothing); then the cases
            # run round-robin, so a background load that drifts over time hits every case alike.
            if any(c in wanted for c in ("gpt", "translation", "vit")):
                servers["service"] = stack.enter_context(
                    service_server(args, "service", repository, vit_batching=True))
                print(f"server 'service' (TSERVE_VIT_BATCHING=true) ready in {servers['service'].ready_seconds:.1f} s",
                      flush=True)
            if "vit" in wanted:
                import httpx

                openapi = httpx.get(f"{servers['service'].url}/openapi.json", timeout=30).json()
                if "/v1/classify" not in openapi.get("paths", {}):
                    skipped["vit"] = "the service has no /v1/classify route yet (service/routes/images.py)"
                    wanted.remove("vit")
                    print(f"vit: skipped ({skipped['vit']})", flush=True)
                else:
                    servers["service-no-batching"] = stack.enter_context(service_server(
                        args, "service-no-batching", repository, vit_batching=False, models=[kinds["vit"].name]))
                    print(f"server 'service-no-batching' (TSERVE_VIT_BATCHING=false, vit only) ready in "
                          f"{servers['service-no-batching'].ready_seconds:.1f} s", flush=True)
            if "baseline" in wanted:
                servers["baseline"] = stack.enter_context(baseline_server(args, gpt_architecture))
                print(f"server 'baseline' (transformers generate() per request) ready in "
                      f"{servers['baseline'].ready_seconds:.1f} s", flush=True)

            if "gpt" in wanted:
                prompts, screening = screen_prompts(servers["service"], prompts, max_new_tokens, args)
                for c in args.gpt_concurrency:
                    cases.append(Case(f"gpt c={c}", "POST /v1/generate (stream, greedy)", servers["service"],
                                      gpt_workload(prompts, max_new_tokens), c, kinds["gpt"].name))
            elif "baseline" in wanted:
                print("note: the gpt case is not selected, so the baseline's prompts are not screened", flush=True)
            if "baseline" in wanted:
                for c in args.baseline_concurrency:
                    cases.append(Case(f"baseline c={c}", "baseline POST /generate (transformers)",
                                      servers["baseline"], baseline_workload(prompts, max_new_tokens), c))
            if "translation" in wanted:
                workload = translation_workload(data_dir, 1014, args.num_beams, translation_tokens or None)
                for c in args.translation_concurrency:
                    cases.append(Case(f"translation c={c}", f"POST /v1/translate (beam {args.num_beams})",
                                      servers["service"], workload, c, kinds["translation"].name))
            if "vit" in wanted:
                vit = vit_workload(data_dir, 1024)
                for label, server in (("on", servers["service"]), ("off", servers["service-no-batching"])):
                    for i, c in enumerate(args.vit_concurrency):
                        name = f"vit batching={label}" + ("" if i == 0 else f" c={c}")
                        cases.append(Case(name, "POST /v1/classify (1 PNG per request)", server, vit, c,
                                          kinds["vit"].name))

            print("\nwarm-up", flush=True)
            for case in cases:
                warmup = args.warmup if args.warmup is not None else \
                    (min(case.concurrency, 4) if args.quick else case.concurrency)
                case.run_warmup(warmup, args.timeout)
            for round_number in range(1, args.rounds + 1):
                print(f"\nround {round_number}/{args.rounds}", flush=True)
                for case in cases:
                    requests = None if args.requests is None else max(1, args.requests // args.rounds)
                    results = case.run_round(args.duration / args.rounds, requests, args.timeout)
                    print(f"  {case.name:<18} c={case.concurrency:<3} {describe_round(case, results)}", flush=True)
        except KeyboardInterrupt:
            interrupted = True
            print("\ninterrupted: stopping the servers; reporting what was measured", flush=True)
    summaries = [case.summary() for case in cases if case.results]
    if summaries:
        print_tables(summaries)
    for summary in summaries:
        for note in summary["notes"]:
            print(f"note ({summary['case']}): {note}")
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    goals = evaluate_goals(summaries)
    print_goals(goals)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")

    report = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join([Path(sys.executable).name] + sys.argv),
        "quick": args.quick, "interrupted": interrupted, "environment": env,
        "settings": {"duration_s": args.duration, "requests": args.requests, "rounds": args.rounds,
                     "warmup": args.warmup, "threads": args.threads, "spin": args.spin,
                     "max_new_tokens": max_new_tokens, "prompt_chars": args.prompt_chars,
                     "num_beams": args.num_beams, "translation_tokens": translation_tokens or None,
                     "random_weights": random_weights, "repository": str(repository),
                     "server_env": args.server_env, "concurrency": {
                         "gpt": args.gpt_concurrency, "baseline": args.baseline_concurrency,
                         "translation": args.translation_concurrency, "vit": args.vit_concurrency}},
        "prompt_screening": screening,
        "servers": [{"name": s.name, "command": s.command, "ready_s": s.ready_seconds, "log": str(s.log_path),
                     "env": {k: v for k, v in s.env.items() if k.startswith(("TSERVE_", "OMP_"))}}
                    for s in servers.values()],
        "cases": summaries, "goals": goals, "skipped": skipped,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
