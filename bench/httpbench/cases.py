"""What is measured: the workloads (request bodies of real data, encoded once) and the cases, one (endpoint,
concurrency) on one server each, accumulated over the interleaved rounds; an `OfflineCase` is a peer's work done
without HTTP (CTranslate2's batches), measured and reported alike."""

from __future__ import annotations

import io
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from spread import sampled_load

from service.client.launcher import ServiceProcess

from .load import Result, Workload, percentiles, round_figures, run_async, run_load
from .servers import batch_stats, grpc_target, process_cpu_seconds

JSON_HEADERS = {"content-type": "application/json"}
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"
GRPC_STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
BOUNDARY = "bench-http-7d1f3a"


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


def gpt_grpc_workload(model: str, prompts: list[str], max_new_tokens: int) -> Workload:
    """The gpt case's requests over gRPC's ModelStreamInfer (tritonclient's raw contents); work = max_new_tokens
    of a stream that ends with "length" (the screened prompts all do; anything else is an error)."""
    from service.api.oip.binary import pack_bytes, unpack_bytes
    from service.api.oip.grpc.generated import grpc_service_pb2 as pb
    from service.api.oip.grpc.wire import to_parameter

    bodies = []
    for prompt in prompts:
        message = pb.ModelInferRequest(model_name=model)
        message.inputs.add(name="PROMPT", datatype="BYTES", shape=[1])
        message.raw_input_contents.append(pack_bytes([prompt.encode()]))
        for key, value in {"max_new_tokens": max_new_tokens, "temperature": 0.0}.items():
            message.parameters[key].CopyFrom(to_parameter(value))
        bodies.append(message.SerializeToString())

    def work(responses) -> float:
        final = {o.name: raw for o, raw in zip(responses[-1].outputs, responses[-1].raw_output_contents)}
        (reason,) = (r.decode() for r in unpack_bytes(final["FINISH_REASON"]))
        if reason != "length":
            raise ValueError(f"finish reason {reason!r}, not length")
        return float(max_new_tokens)

    return Workload(GRPC_STREAM_INFER, bodies, {}, stream=True, unit="tokens/s", work=work, grpc=True)


def vit_grpc_workload(model: str, data_dir: Path, count: int) -> Workload:
    """The vit case's images over gRPC's ModelInfer: one PNG per request as the raw BYTES input IMAGE."""
    from PIL import Image

    from models.data import load_fashion_mnist
    from service.api.oip.binary import pack_bytes
    from service.api.oip.grpc.generated import grpc_service_pb2 as pb

    images, _ = load_fashion_mnist(data_dir, "test")
    bodies = []
    for pixels in images[:count]:
        png = io.BytesIO()
        Image.fromarray(pixels, mode="L").save(png, format="PNG")
        message = pb.ModelInferRequest(model_name=model)
        message.inputs.add(name="IMAGE", datatype="BYTES", shape=[1])
        message.raw_input_contents.append(pack_bytes([png.getvalue()]))
        bodies.append(message.SerializeToString())

    def work(response) -> float:
        probabilities = next(o for o in response.outputs if o.name == "PROBABILITIES")
        return float(probabilities.shape[0])

    return Workload(GRPC_INFER, bodies, {}, unit="images/s", work=work, grpc=True)


def baseline_workload(prompts: list[str], max_new_tokens: int) -> Workload:
    bodies = [json.dumps({"prompt": p, "max_new_tokens": max_new_tokens}).encode() for p in prompts]
    return Workload("/generate", bodies, JSON_HEADERS, unit="tokens/s",
                    work=lambda payload: float(payload["completion_tokens"]))


def translation_sentences(data_dir: Path, count: int) -> list[str]:
    """The first `count` German sentences of Multi30k's validation split."""
    from models.data import load_multi30k

    return [de for de, _ in load_multi30k(data_dir, "val")][:count]


def translation_workload(data_dir: Path, count: int, num_beams: int, new_tokens: int | None) -> Workload:
    sentences = translation_sentences(data_dir, count)
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



@dataclass
class Case:
    """One (endpoint, concurrency) measurement on one server, accumulated over the interleaved rounds."""

    name: str
    endpoint: str
    server: ServiceProcess
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
    rounds: list[dict] = field(default_factory=list)  # each round's figures (`load.round_figures`), in order
    loads: list[tuple[float, float]] = field(default_factory=list)  # the 1-minute load before / after each round

    @property
    def target(self) -> str:
        """Where the load goes: the server's URL, or its gRPC port (host:port) for a gRPC workload."""
        return grpc_target(self.server) if self.workload.grpc else self.server.url

    def load(self, duration: float, requests: int | None, timeout: float) -> tuple[list[Result], float]:
        """Send `requests` requests (or for `duration` seconds) from the next body on: the results and the client's
        CPU seconds."""
        return run_async(run_load(self.target, self.workload, self.concurrency, requests=requests, duration=duration,
                                  offset=self.sent, timeout=timeout), uvloop_allowed=not self.workload.grpc)

    def run_warmup(self, requests: int, timeout: float) -> None:
        self.warmup = requests
        if requests:
            self.load(0.0, requests, timeout)
            self.sent += requests

    def run_round(self, duration: float, requests: int | None, timeout: float) -> list[Result]:
        batches = batch_stats(self.server.url) if self.model else {}
        cpu_before = process_cpu_seconds(self.server.pid)
        with sampled_load(self.loads):
            results, client_cpu = self.load(duration, requests, timeout)
        cpu_after = process_cpu_seconds(self.server.pid)
        self.sent += len(results)
        self.results += results
        self.client_cpu += client_cpu
        self.rounds.append(round_figures(results, self.workload.stream))
        self.wall += self.rounds[-1]["wall_s"]
        if cpu_before is None or cpu_after is None or self.server_cpu is None:
            self.server_cpu = self.loop_cpu = None
        else:
            self.server_cpu += cpu_after[0] - cpu_before[0]
            self.loop_cpu += cpu_after[1] - cpu_before[1]
        if self.model and self.model in batches:
            after = batch_stats(self.server.url).get(self.model, batches[self.model])
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
            "latency_ms": percentiles([r.latency for r in ok]),
            "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]) if self.workload.stream else None,
            "finish_reasons": dict(Counter(r.finish_reason for r in ok if r.finish_reason)),
            "notes": sorted({r.note for r in results if r.note})[:5],
            "server_cpu_s": self.server_cpu, "server_main_thread_cpu_s": self.loop_cpu,
            "client_cpu_s": self.client_cpu,
            "work_per_server_cpu_s": work / self.server_cpu if self.server_cpu else None,
            "mean_batch": self.batch_sum / self.batch_count if self.batch_count else None,
            "warmup_requests": self.warmup, "rounds": self.rounds, "load_before_after": self.loads,
        }


@dataclass
class OfflineCase(Case):
    """A peer's work without HTTP, as a case: `call(i)` runs the i-th unit of work (a batch) in the peer's own
    process (`server`: its pid, for the CPU seconds) and returns its work; one call at a time, so `concurrency` is
    1 and a "request" is a call. Its mean batch is the work per call."""

    call: Callable[[int], float] | None = None

    def load(self, duration: float, requests: int | None, timeout: float) -> tuple[list[Result], float]:
        """Calls back to back, from the next on, until `requests` calls (or `duration` seconds); the first that
        fails (the peer's process gone: a closed pipe) ends the round."""
        results: list[Result] = []
        cpu, stop_at = time.process_time(), time.perf_counter() + duration
        while (len(results) < requests) if requests is not None else (time.perf_counter() < stop_at):
            start = time.perf_counter()
            result = Result(start, start, index=self.sent + len(results))
            try:
                result.work = self.call(result.index)
            except (OSError, EOFError, RuntimeError) as error:
                result.error = type(error).__name__
            result.end = time.perf_counter()
            results.append(result)
            if result.error is not None:
                break
        return results, time.process_time() - cpu

    def run_round(self, duration: float, requests: int | None, timeout: float) -> list[Result]:
        results = super().run_round(duration, requests, timeout)
        ok = [r for r in results if r.error is None]
        self.batch_sum += sum(r.work for r in ok)
        self.batch_count += len(ok)
        return results


def screen_prompts(server: ServiceProcess, prompts: list[str], max_new_tokens: int, args) -> tuple[list[str], dict]:
    """Greedy is deterministic: run every prompt once (this also warms the server up) and keep those that run to
    max_new_tokens without EOS, so that every measured request (ours and the baseline's) does the same work."""
    workload = gpt_workload(prompts, max_new_tokens)
    results, _ = run_async(run_load(server.url, workload, min(32, len(prompts)), requests=len(prompts),
                                    duration=0.0, offset=0, timeout=args.timeout))
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

