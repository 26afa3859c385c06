"""The load generator: N client tasks on one event loop, each with its own keep-alive connection (an HTTP client,
or a gRPC channel), sending requests back to back (a closed loop); every request becomes a Result (timings, work,
error). A stream's server-sent events are read by its workload's `events` reader: the service's own (`/v1/generate`,
`native_event`) or OpenAI's text completion chunks (llama-server's `/v1/completions`, `completion_chunk_event`)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from service.client.sse import SSEParser


@dataclass(frozen=True)
class StreamEvent:
    """What one server-sent event of a stream says: `tokens` generated, or the stream's end (`finish_reason`, with
    the `usage` if it gives one), or an `error`."""

    tokens: int = 0
    finish_reason: str | None = None
    usage: dict | None = None
    error: str | None = None


def _error_event(event: dict) -> StreamEvent:
    return StreamEvent(error=f"SSE error: {event['error'].get('type')}")


def native_event(event: dict) -> StreamEvent:
    """The service's `/v1/generate` stream: `{"token"}` per token, a last event with `finish_reason` and `usage`
    (its `token`, the text held back, is no new token), or `{"error"}`."""
    if "error" in event:
        return _error_event(event)
    if "finish_reason" in event:
        return StreamEvent(finish_reason=event["finish_reason"], usage=event.get("usage"))
    return StreamEvent(tokens=1)


def completion_chunk_event(event: dict) -> StreamEvent:
    """An OpenAI text completion chunk (`/v1/completions`, stream, one choice): a token per chunk until the one
    whose choice has a `finish_reason` (with the `usage`; llama-server sends its text empty); a chunk without
    choices carries the usage alone; or `{"error"}`. A missing `choices` is a KeyError: not this stream's shape."""
    if "error" in event:
        return _error_event(event)
    if not event["choices"]:
        return StreamEvent(usage=event.get("usage"))
    (choice,) = event["choices"]
    if choice.get("finish_reason") is not None:
        return StreamEvent(finish_reason=choice["finish_reason"], usage=event.get("usage"))
    return StreamEvent(tokens=1)


@dataclass
class Workload:
    """The requests of a case: `bodies` (encoded once) sent in turn to `path`; `work` counts the units of a JSON
    response (a stream's are its token events). With `grpc`, `path` is the gRPC method, the bodies are serialized
    `ModelInferRequest`s, and `work` reads the response message (a stream's: the list of its responses). A stream's
    events are read by `events` (see `StreamEvent`); its work is its token events, or with `usage_tokens` the
    `completion_tokens` of its usage (an event may carry several tokens: a speculative step's accepted draft)."""

    path: str
    bodies: list[bytes]
    headers: dict[str, str]
    stream: bool = False
    unit: str = "requests/s"
    work: Callable[[object], float] = lambda payload: 1.0  # work units in a successful response
    grpc: bool = False
    events: Callable[[dict], StreamEvent] = native_event
    usage_tokens: bool = False


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
    """One streamed generate request: SSE events until [DONE], read by the workload's `events`; work = generated
    tokens (checked against the usage, when the stream gives one)."""
    import httpx

    start = time.perf_counter()
    result = Result(start, start)
    tokens, usage, sse = 0, None, SSEParser()
    try:
        async with client.stream("POST", workload.path, content=body, headers=workload.headers) as response:
            if not 200 <= response.status_code < 300:
                await response.aread()
                result.error = f"HTTP {response.status_code}"
            else:
                async for line in response.aiter_lines():
                    event = sse.feed_line(line)
                    if sse.done:
                        break
                    if event is None:
                        continue
                    said = workload.events(event)
                    if said.error is not None:
                        result.error = said.error
                    elif said.finish_reason is not None:
                        result.finish_reason = said.finish_reason
                    elif said.tokens and result.ttft is None:
                        result.ttft = time.perf_counter() - start
                    usage = said.usage if said.usage is not None else usage
                    tokens += said.tokens
    except (httpx.HTTPError, OSError, ValueError, KeyError, TypeError) as error:
        result.error = type(error).__name__
    result.end = time.perf_counter()
    if result.error is None and not sse.done:
        result.error = "stream ended without [DONE]"
    if result.error is None:
        result.work = float(tokens)
        if workload.usage_tokens:
            if usage is None or not isinstance(usage.get("completion_tokens"), int):
                result.error = "stream without usage"
            else:
                result.work = float(usage["completion_tokens"])
        elif usage is not None and usage.get("completion_tokens") != tokens:
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


async def send_grpc(channel, workload: Workload, body: bytes) -> Result:
    """One gRPC call: ModelInfer (work from its response), or ModelStreamInfer (work from its responses, to the one
    flagged final; time to first token at the first)."""
    import grpc

    from service.api.oip.grpc.generated import grpc_service_pb2 as pb
    from service.api.oip.grpc.wire import FINAL_RESPONSE

    start = time.perf_counter()
    result = Result(start, start)
    try:
        if workload.stream:
            call = channel.stream_stream(workload.path, response_deserializer=pb.ModelStreamInferResponse.FromString)
            responses = []
            async for answer in call(iter([body])):  # the body is sent as it is (no serializer: bytes)
                if answer.error_message:
                    result.error = f"stream error: {answer.error_message[:60]}"
                    break
                if result.ttft is None:
                    result.ttft = time.perf_counter() - start
                responses.append(answer.infer_response)
                if answer.infer_response.parameters[FINAL_RESPONSE].bool_param:
                    break
            else:
                result.error = result.error or "stream ended without a final response"
            if result.error is None:
                result.work = workload.work(responses)
        else:
            call = channel.unary_unary(workload.path, response_deserializer=pb.ModelInferResponse.FromString)
            result.work = workload.work(await call(body))
    except grpc.RpcError as error:
        result.error = f"gRPC {error.code().name}"
    except (ValueError, KeyError, IndexError) as error:
        result.error = type(error).__name__
    result.end = time.perf_counter()
    return result


async def run_load(base_url: str, workload: Workload, concurrency: int, *, requests: int | None, duration: float,
                   offset: int, timeout: float) -> tuple[list[Result], float]:
    """Closed loop: `concurrency` tasks send requests back to back, cycling through the bodies, until `requests`
    have been sent (or `duration` seconds have passed); returns the results and the client's CPU seconds.
    `base_url`: the server's URL, or host:port of its gRPC port for a gRPC workload.

    Each task has its own AsyncClient (one keep-alive connection): one client shared by 64 tasks costs ~5 ms of
    client CPU per request in httpcore's pool bookkeeping (measured here), against ~0.7 ms with one per task. A
    gRPC task has its own channel (one HTTP/2 connection) likewise."""
    import httpx

    if workload.grpc:
        import grpc

        send: Callable[..., Awaitable[Result]] = send_grpc
        clients = [grpc.aio.insecure_channel(base_url) for _ in range(concurrency)]
    else:
        send = send_stream if workload.stream else send_json
        clients = [httpx.AsyncClient(base_url=base_url, timeout=timeout,
                                     limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
                   for _ in range(concurrency)]
    results: list[Result] = []
    counter = itertools.count()
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
            await (client.close() if workload.grpc else client.aclose())
    return results, cpu


def run_async(coroutine, uvloop_allowed: bool = True):
    """Run on uvloop when it is installed (and allowed: grpc.aio runs on asyncio's own loop)."""
    try:
        if not uvloop_allowed:
            raise ImportError
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coroutine)
    except ImportError:
        return asyncio.run(coroutine)


def round_figures(results: list[Result], stream: bool) -> dict:
    """The figures of one case's round that its ratios are taken of, per round (`report.case_metric` reads them as
    it reads a case's summary): wall time (first start to last end), successes, errors, work, throughput (work/s),
    latency and, for a stream, time to first token (ms)."""
    ok = [r for r in results if r.error is None]
    wall = (max(r.end for r in results) - min(r.start for r in results)) if results else 0.0
    work = sum(r.work for r in ok)
    return {"wall_s": wall, "ok": len(ok), "errors": len(results) - len(ok), "work": work,
            "throughput": work / wall if wall > 0 else 0.0, "latency_ms": percentiles([r.latency for r in ok]),
            "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]) if stream else None}


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    array = np.asarray(values) * scale
    return {"p50": float(np.percentile(array, 50)), "p95": float(np.percentile(array, 95)),
            "p99": float(np.percentile(array, 99)), "mean": float(array.mean())}

