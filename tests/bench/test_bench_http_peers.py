"""bench/bench_http.py's C++ peers without a benchmark: the ratio lines (`service/llama-server 1 streams = 0.84`) and
their rows when a peer could not run (llama.cpp not built: `make llama-cpp`), the requests llama-server is sent and
how the shared streaming client reads its OpenAI chunks, the CTranslate2 offline case driven by a fake worker (and
once by a real one on a tiny translator), and one server running at a time (real `sleep` processes stopped and
continued). No llama.cpp build and no service are needed."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT

BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_http  # noqa: E402 - after the sys.path set-up, as the script's own
from enginebench import llama_cpp  # noqa: E402
from httpbench import ct2_offline, llama_server  # noqa: E402
from httpbench.load import StreamEvent, completion_chunk_event, native_event, send_stream  # noqa: E402
from httpbench.report import evaluate_peers, peer_line, peer_ratios, print_peers  # noqa: E402
from httpbench.servers import resume, run_alone, server_record  # noqa: E402

STOP_WAIT_S = 5.0  # how long a signalled process may take to show its new state in /proc


def summary(case: str, throughput: float, errors: int = 0, unit: str = "tokens/s") -> dict:
    return {"case": case, "throughput": throughput, "errors": errors, "unit": unit}


def test_the_ratio_lines_are_exactly_the_issues():
    labels = [r.label for r in peer_ratios([1, 32], [16])]
    assert labels == ["service/llama-server 1 streams", "service/llama-server 32 streams",
                      "service/llama-server-q8_0 1 streams", "service/llama-server-q8_0 32 streams",
                      "service-http 16 clients/ctranslate2 offline b16"]
    cases = [summary("gpt c=1", 840.0), summary("llama-server c=1", 1000.0), summary("gpt c=32", 1290.0),
             summary("llama-server c=32", 1000.0), summary("llama-q8_0 c=1", 700.0),
             summary("llama-q8_0 c=32", 1500.0), summary("translation c=16", 35.5, unit="sentences/s"),
             summary(ct2_offline.CASE_NAME, 50.0, unit="sentences/s")]
    rows = evaluate_peers(cases, peer_ratios([1, 32], [16]), {})
    assert [peer_line(row) for row in rows] == ["service/llama-server 1 streams = 0.84",
                                                "service/llama-server 32 streams = 1.29",
                                                "service/llama-server-q8_0 1 streams = 1.20",
                                                "service/llama-server-q8_0 32 streams = 0.86",
                                                "service-http 16 clients/ctranslate2 offline b16 = 0.71"]
    assert rows[0] | {"value": None} == {
        "ratio": "service/llama-server 1 streams", "value": None, "reason": None, "unit": "tokens/s",
        "numerator": "gpt c=1", "denominator": "llama-server c=1", "service_throughput": 840.0,
        "peer_throughput": 1000.0, "errors_in_cases": 0, "spread": None}  # without rounds (test_bench_spread.py)
    assert json.loads(json.dumps(rows)) == rows  # as the JSON report holds them


def test_without_llama_cpp_the_rows_say_so_and_name_the_make_target(capsys):
    skipped = {"llama-server": llama_cpp.NOT_BUILT}
    rows = evaluate_peers([summary("gpt c=1", 840.0)], peer_ratios([1], []), skipped)
    assert peer_line(rows[0]) == "service/llama-server 1 streams = n/a (llama.cpp is not built: run `make llama-cpp`)"
    print_peers(rows)
    assert "service/llama-server 1 streams = n/a" in capsys.readouterr().out


def test_a_row_names_the_missing_case_and_the_errors():
    rows = evaluate_peers([summary(ct2_offline.CASE_NAME, 50.0, errors=2, unit="sentences/s")],
                          peer_ratios([], [16]), {})
    assert rows[0]["value"] is None and "--cases without translation" in rows[0]["reason"]
    assert peer_line(rows[0]).endswith("[errors in these cases: 2]")
    rows = evaluate_peers([summary("gpt c=1", 840.0, errors=1), summary("llama-server c=1", 0.0)],
                          peer_ratios([1], []), {})
    assert rows[0]["reason"] == "no throughput in llama-server c=1"


def test_the_peers_are_cases_of_the_command_line():
    args = bench_http.parse_args(["--quick"])
    assert {"llama-server", "llama-server-q8_0", "ctranslate2"} <= set(args.cases)
    assert set(bench_http.PEERS) <= set(bench_http.CASES) and set(llama_server.SERVERS) <= set(bench_http.PEERS)
    assert set(llama_server.SERVERS) <= set(bench_http.SERVICE_CASES)  # their prompts are screened on the service
    assert bench_http.parse_args(["--cases", "gpt,llama-server"]).cases == ["gpt", "llama-server"]
    assert args.rounds == bench_http.QUICK_ROUNDS >= 2 and bench_http.parse_args([]).rounds == bench_http.ROUNDS >= 3
    assert bench_http.parse_args(["--rounds", "5"]).rounds == 5
    with pytest.raises(SystemExit):
        bench_http.parse_args(["--cases", "llama.cpp"])


def test_without_a_build_llama_server_is_not_started_and_nothing_is_converted(monkeypatch, tmp_path):
    monkeypatch.setattr(llama_cpp, "BUILD_BIN", tmp_path / "absent")
    args = types.SimpleNamespace(workdir=tmp_path / "work", threads=2, spin=False)
    with pytest.raises(NotImplementedError, match=r"run `make llama-cpp`"):
        llama_server.llama_server(args, tmp_path / "repository-x", 256, 32)
    assert not (tmp_path / "work").exists()


def test_the_q8_0_peer_serves_the_gpt_with_its_matmul_weights_in_q8_0(tmp_path):
    """`llama-server-q8_0` converts the served GPT's weights to a GGUF whose matmul weights are q8_0 (the rest f32),
    beside the f32 peer's file; its cases' names fit the tables' case column."""
    from gguf import GGMLQuantizationType, GGUFReader

    peer = llama_server.SERVERS["llama-server-q8_0"]
    assert peer.file_type == "q8_0" and llama_server.SERVERS[llama_server.F32].file_type == "f32"
    assert llama_server.case_name(32, "llama-server-q8_0") == "llama-q8_0 c=32"
    assert all(len(llama_server.case_name(256, option)) <= 18 for option in llama_server.SERVERS)
    path = llama_server.gguf_file(tmp_path / "repository-x", tmp_path / "work", peer.file_type)
    assert path.parent.name == "llama-cpp-gpt-q8_0"
    types = {t.name: t.tensor_type for t in GGUFReader(str(path)).tensors}
    quantized = {name for name in types if name.endswith(llama_cpp.QUANTIZED)}
    assert quantized and {types[name] for name in quantized} == {GGMLQuantizationType.Q8_0}
    assert {types[name] for name in set(types) - quantized} == {GGMLQuantizationType.F32}


def test_llama_server_is_sent_the_prompt_ids_greedy_for_exactly_the_tokens():
    workload = llama_server.llama_server_workload([[70, 105, 114], [66]], 64)
    assert workload.path == "/v1/completions" and workload.stream and workload.unit == "tokens/s"
    assert workload.events is completion_chunk_event
    body = json.loads(workload.bodies[0])
    assert body == {"prompt": [70, 105, 114], "stream": True, "n_predict": 64, "ignore_eos": True,
                    "cache_prompt": False, "samplers": ["top_k"], "top_k": 1}
    assert json.loads(workload.bodies[1])["prompt"] == [66]


def chunk(text: str, finish_reason: str | None = None, **extra) -> dict:
    return {"choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}],
            "object": "text_completion", **extra}


def test_the_stream_readers_count_tokens_and_find_the_end():
    assert completion_chunk_event(chunk("101")) == StreamEvent(tokens=1)
    usage = {"completion_tokens": 2, "prompt_tokens": 31}
    assert completion_chunk_event(chunk("", "length", usage=usage)) == StreamEvent(finish_reason="length",
                                                                                  usage=usage)
    assert completion_chunk_event({"choices": [], "usage": usage}) == StreamEvent(usage=usage)
    assert completion_chunk_event({"error": {"type": "server_error"}}).error == "SSE error: server_error"
    assert native_event({"token": "a", "index": 0}) == StreamEvent(tokens=1)
    assert native_event({"token": "", "index": 3, "finish_reason": "length", "usage": usage}) == \
        StreamEvent(finish_reason="length", usage=usage)


def sse(events: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def stream_result(events: list[dict], workload):
    """send_stream (the benchmark's one streaming client) against a stream of `events` and [DONE]."""

    async def run():
        transport = httpx.MockTransport(lambda request: httpx.Response(
            200, content=sse(events), headers={"content-type": "text/event-stream"}))
        async with httpx.AsyncClient(transport=transport, base_url="http://peer") as client:
            return await send_stream(client, workload, workload.bodies[0])

    return asyncio.run(run())


def test_the_streaming_client_reads_llama_servers_chunks():
    workload = llama_server.llama_server_workload([[70, 105]], 3)
    usage = {"completion_tokens": 3, "prompt_tokens": 2, "total_tokens": 5}
    result = stream_result([chunk("7"), chunk("101"), chunk("32"), chunk("", "length", usage=usage)], workload)
    assert (result.error, result.work, result.finish_reason, result.note) == (None, 3.0, "length", None)
    assert result.ttft is not None and result.ttft <= result.latency
    result = stream_result([chunk("7"), chunk("", "length", usage=usage)], workload)
    assert result.work == 1.0 and result.note == "usage says 3 tokens, 1 token events"
    result = stream_result([chunk("7"), {"error": {"type": "unavailable_error"}}], workload)
    assert result.error == "SSE error: unavailable_error" and result.work == 0.0
    assert stream_result([{"object": "not a completion"}], workload).error == "KeyError"


class FakeWorker:
    """ct2.Worker's interface: each source -> `new_tokens` tokens (`short` makes one of them a token short)."""

    name, pid = "ctranslate2", 0

    def __init__(self, short: bool = False):
        self.calls: list[tuple[list[list[int]], int, int]] = []
        self.short = short

    def translate(self, sources, num_beams, new_tokens):
        self.calls.append((sources, num_beams, new_tokens))
        best = [[5] * new_tokens for _ in sources]
        if self.short:
            best[-1] = best[-1][:-1]
        return best


def test_the_offline_case_cycles_through_the_sentences_in_batches():
    sources = [[i, 2] for i in range(3, 23)]  # 20 sentences: the second batch wraps around
    assert ct2_offline.batch_of(sources, 0) == sources[:16]
    assert ct2_offline.batch_of(sources, 1) == sources[16:] + sources[:12]
    worker = FakeWorker()
    case = ct2_offline.ctranslate2_case(worker, sources, num_beams=4, new_tokens=30)
    case.run_warmup(1, timeout=1.0)
    results = case.run_round(0.0, requests=3, timeout=1.0)
    assert [r.index for r in results] == [1, 2, 3] and all(r.error is None and r.work == 16 for r in results)
    assert [call[1:] for call in worker.calls] == [(4, 30)] * 4 and worker.calls[1][0] == sources[16:] + sources[:12]
    row = case.summary()
    assert (row["case"], row["server"], row["concurrency"], row["unit"]) == ("ctranslate2 b=16", "ctranslate2", 1,
                                                                            "sentences/s")
    assert row["ok"] == 3 and row["work"] == 48 and row["throughput"] > 0 and row["mean_batch"] == 16
    assert row["warmup_requests"] == 1


def test_a_short_translation_is_an_error_that_ends_the_round():
    case = ct2_offline.ctranslate2_case(FakeWorker(short=True), [[3, 2]], num_beams=4, new_tokens=30)
    results = case.run_round(60.0, requests=None, timeout=1.0)  # would run a minute without the first error
    assert len(results) == 1 and results[0].error == "RuntimeError"
    assert case.summary()["errors"] == 1 and case.summary()["mean_batch"] is None


def test_the_ctranslate2_worker_translates_a_batch_as_the_case_asks(tmp_path):
    pytest.importorskip("ctranslate2")
    import torch

    from enginebench import ct2
    from models.config import TranslationConfig
    from models.transformer import EncoderDecoderTransformer

    torch.manual_seed(0)
    config = TranslationConfig(vocab_size=100, d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                               d_ff=64, dropout=0.0, max_positions=32)
    folder = ct2.convert(EncoderDecoderTransformer(config).eval(), tmp_path / "ct2")
    with ct2.Worker(folder, ct2_offline.COMPUTE_TYPE, threads=1) as worker:
        case = ct2_offline.ctranslate2_case(worker, [[5, 6, 7, 2], [9, 2]], num_beams=2, new_tokens=5)
        (result,) = case.run_round(0.0, requests=1, timeout=10.0)
        assert result.error is None and result.work == ct2_offline.BATCH
        assert case.summary()["server_cpu_s"] is not None
    assert not worker.process.is_alive()


STOPPED, RUNNING = {"T"}, {"S", "R"}  # /proc states: stopped; sleeping or running


def state(process: subprocess.Popen) -> str:
    """The process's state letter in /proc."""
    return Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def reaches(process: subprocess.Popen, states: set[str]) -> bool:
    """Whether the process is in one of `states` within STOP_WAIT_S (a signal takes effect asynchronously)."""
    deadline = time.monotonic() + STOP_WAIT_S
    while state(process) not in states and time.monotonic() < deadline:
        time.sleep(0.01)
    return state(process) in states


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_one_server_runs_at_a_time():
    # a process-group leader (as the launcher starts the service) and two plain children (llama-server, the worker)
    processes = [subprocess.Popen(["sleep", "30"], start_new_session=new) for new in (True, False, False)]
    try:
        run_alone(processes[1], processes)
        assert [reaches(p, RUNNING if i == 1 else STOPPED) for i, p in enumerate(processes)] == [True] * 3
        run_alone(processes[0], processes)
        assert reaches(processes[0], RUNNING) and reaches(processes[1], STOPPED) and reaches(processes[2], STOPPED)
        for process in processes:
            resume(process)
        assert all(reaches(p, RUNNING) for p in processes)
    finally:
        for process in processes:
            process.send_signal(signal.SIGCONT)
            process.kill()
            process.wait()


def test_a_peer_is_recorded_like_a_server(tmp_path):
    peer = types.SimpleNamespace(name="llama-server", command=["llama-server", "-np", "32"], ready_seconds=0.5,
                                 log_path=tmp_path / "llama-server.log",
                                 environment={"OMP_NUM_THREADS": "2", "PATH": "/bin"})
    assert server_record(peer) == {"name": "llama-server", "command": ["llama-server", "-np", "32"], "ready_s": 0.5,
                                   "log": str(tmp_path / "llama-server.log"), "env": {"OMP_NUM_THREADS": "2"}}
    assert server_record(FakeWorker()) == {"name": "ctranslate2", "command": None, "ready_s": None, "log": None,
                                           "env": {}}


def test_the_benchmark_models_carry_the_shipped_models_evaluation_choices():
    """The random-weight ViT does what the served one does per image (vit/4: its flip averaging, chosen on
    validation: twice the work), and a kind whose evaluation chose nothing builds as its preset says."""
    from httpbench.repository import random_model
    from shipped import shipped_choices

    assert shipped_choices("vit") == {"flip_average": True}
    assert shipped_choices("gpt") == shipped_choices("translation") == {}
    assert random_model("vit").config.flip_average is True
