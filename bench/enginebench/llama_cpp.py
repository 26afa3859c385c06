"""llama.cpp (`make llama-cpp` builds it from source: bench/build_llama_cpp.sh), the C++ engine a user would
otherwise pick to serve a small GPT on a CPU, on the SAME weights as ours: our `models.gpt.GPT` written as a GGUF
file of llama.cpp's `gpt2` architecture (`write_gguf`), a `GenerateFn` over `llama-server` (`run_llama_cpp_gpt`,
the timed system), the tool's own benchmark `llama-batched-bench` as a row of its own (`batched_bench`), and how far
its greedy tokens agree with ours (`agreement`). It follows ct2.py, the translator's C++ peer. bench/bench_http.py
runs the same `Server` on the served GPT's weights (`write_gguf`) and streams the same request fields
(`completion_fields`) from its HTTP clients (bench/httpbench/llama_server.py).

The conversion, tensor by tensor (models/gpt.py, models/layers.py -> llama.cpp's src/models/gpt2.cpp): the token
and learned position embeddings (`token_embd`, `position_embd`); per block the Pre-LN norms (`attn_norm`,
`ffn_norm`), the q, k and v projections concatenated into the fused `attn_qkv` ([q; k; v] along the output rows:
llama.cpp splits it in that order, and each part into heads as ours does), `attn_output`, `ffn_up` and `ffn_down`,
every one with its bias; the final norm (`output_norm`); no `output` tensor, so llama.cpp ties the head to
`token_embd`, as ours is. LayerNorm epsilon 1e-5 (PyTorch's). Weights f32 (`file_types`: q8_0 quantizes the matmul
weights, the norms and biases stay f32). The vocabulary is the ids themselves written as tokens ("0", "1", ...), as
for CTranslate2, so that llama.cpp takes and returns our ids: a `gpt2` (BPE) tokenizer, because llama.cpp's loader
(src/llama-vocab.cpp) gives a vocabulary of type "none" no tokens, and the server turns every token it samples into
text; the BPE loader requires merges, so they spell each id of two or more digits from its prefix and its last digit
(text is never tokenized here: prompts go in as ids). PAD, BOS and EOS are control tokens, EOS (the model's own,
`config.eos_id`: the bench GPT's EOS_ID, the byte-level served GPT's 256) ends generation, and no BOS is added to
a prompt.

Where llama.cpp computes differently, by its own design: its `gpt2` graph applies GELU's tanh approximation
(`ggml_gelu`), looked up in a table over fp16-rounded inputs (ggml-cpu's GGML_GELU_FP16), where ours computes the
exact erf GELU in fp32 (F.gelu); and its KV cache is f16, its default (`KV_CACHE_TYPE`), ours float32; the
weights are f32. So two greedy continuations on random weights agree until a near-tie between the two
best logits flips, and then part: `agreement` reports where each sequence first diverges, not only identity
(measured on the bench's GPT against our engine, 2026-12: all 16 sequences of batch 16 identical, 128 tokens each).

Fairness (bench/bench_engine.py's rules): the same prompts; greedy (top-k 1) with EOS masked (`ignore_eos`: its
logit set to -inf, as ours masks it under `min_new_tokens`), exactly `spec.new_tokens` tokens per row; the bench's
thread count (`-t`, `-tb`); no prompt caching across requests (each pass runs its prompt pass, as ours does). The
server is a process of its own, started with as many slots (`-np`) as the batch has rows, all rows decoded together,
and stopped (SIGSTOP) between its passes, so that its threads take no core from the systems timed in between;
its timing includes one local HTTP request per pass. Its threads keep llama.cpp's own wait policy: the bench's
OMP_WAIT_POLICY=PASSIVE (torch's pool) is not passed on, as for CTranslate2; they spin at ggml's barriers, so on
cores that other jobs keep busy its times scatter widely (the same llama-batched-bench command took 0.1 s and 5 s,
minutes apart, on a loaded 2-core machine): compare its ratios on an otherwise idle one.
"""

from __future__ import annotations

import atexit
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np

from . import PROJECT_ROOT
from .ours import gpt_config
from .workloads import BOS_ID, EOS_ID, PAD_ID, GenerateFn, GptSpec, Runtime, seed_torch, spec_dir

BUILD_BIN = PROJECT_ROOT / ".cache" / "llama.cpp" / "build" / "bin"  # bench/build_llama_cpp.sh's output
SERVER, BATCHED_BENCH = "llama-server", "llama-batched-bench"
NOT_BUILT = "llama.cpp is not built: run `make llama-cpp`"
# llama-batched-bench prints its table through llama.cpp's asynchronous logger, whose singleton is never flushed at
# exit (common/log.cpp, `common_log_main`: "logs may be lost if not flushed before the program exits"): a run whose
# last line is its only row can exit 0 without it, 3 times in 5 at batch 1 here (2026-12-04, the bench's GGUF,
# alone). A run without its row is retried, this many times in all, before the row is reported as failed.
BATCHED_BENCH_ATTEMPTS = 12

ARCHITECTURE = "gpt2"  # llama.cpp's GPT-2: learned positions, Pre-LN with biases, fused QKV, tied head, GELU
TOKENIZER_MODEL, TOKENIZER_PRE = "gpt2", "default"
LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default, which our model uses
GGUF_FILE = "model.gguf"
# the matmul weights a quantized file stores quantized (llama.cpp's convention: norms, biases and positions stay f32)
QUANTIZED = ("token_embd.weight", "attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight")
# -ctk / -ctv: llama.cpp's default, f16. An f32 cache (as ours) made it 3.4x slower at batch 16 (llama-batched-bench
# S_TG 1,730 vs 5,969 tokens/s; batch 1: 2,387 vs 3,228; AMD EPYC AVX-512, 2 cores, 2026-12-01): a user keeps the
# default
KV_CACHE_TYPE = "f16"

# llama.cpp's repacked weights on a CPU with AMX-INT8 run its AMX kernels (ggml-cpu/amx), which on this VM's Intel
# Xeon (AMX granted to the process) died of SIGILL at their first `tilezero` (gdb: tinygemm_kernel_amx<block_q8_0>),
# in llama-server's warm-up and llama-batched-bench alike; `--no-repack` (its documented switch) runs the plain
# q8_0 kernels. `repack_options` probes each GGUF once and adds it only where the default dies so.
NO_REPACK = "--no-repack"
# the bench's llama.cpp systems and the GGUF file type each runs (`file_types`); llama-batched-bench runs on each too
SYSTEM_FILE_TYPES = {"llama.cpp": "f32", "llama.cpp-q8_0": "q8_0"}
ILLEGAL_INSTRUCTION = (-signal.SIGILL, 128 + signal.SIGILL)  # killed by the signal / a shell's exit status for it
_REPACK_OPTIONS: dict[Path, list[str]] = {}

HOST = "127.0.0.1"
SERVER_START_TIMEOUT_S = 120.0
SERVER_POLL_S = 0.1
REQUEST_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 10.0
GREEDY = {"samplers": ["top_k"], "top_k": 1}  # the sampler chain: argmax (after the logit biases: EOS masked)

# llama-batched-bench's printed table, its header cells -> our keys (times in seconds, speeds in tokens/s)
BATCHED_BENCH_COLUMNS = {"PP": "pp", "TG": "tg", "B": "batch", "N_KV": "n_kv", "T_PP s": "t_pp",
                         "S_PP t/s": "speed_pp", "T_TG s": "t_tg", "S_TG t/s": "speed_tg", "T s": "t",
                         "S t/s": "speed"}
INTEGER_COLUMNS = ("pp", "tg", "batch", "n_kv")


def file_types():
    """GGUF file type name -> (llama.cpp's file type, the quantization of the `QUANTIZED` weights or None)."""
    from gguf import GGMLQuantizationType, LlamaFileType

    return {"f32": (LlamaFileType.ALL_F32, None),
            "q8_0": (LlamaFileType.MOSTLY_Q8_0, GGMLQuantizationType.Q8_0)}


def gpt_model(spec: GptSpec):
    """Our GPT with random weights (seed 0) at `spec`'s sizes: the model `ours.ours_gpt_version` exports (the same
    config, built right after the same seed)."""
    from models.gpt import GPT

    seed_torch(0)
    return GPT(gpt_config(spec)).eval()


def vocabulary(vocab_size: int, eos_id: int = EOS_ID) -> tuple[list[str], list[int], list[str]]:
    """The tokens (each id as a string), their types (PAD, BOS and the model's EOS `eos_id` control, the rest
    normal) and the merges that spell every token of two or more characters from its prefix and last character (see
    the module's docstring)."""
    from gguf import TokenType

    tokens = [str(i) for i in range(vocab_size)]
    control = (PAD_ID, BOS_ID, eos_id)
    types = [int(TokenType.CONTROL if i in control else TokenType.NORMAL) for i in range(vocab_size)]
    merges = [f"{token[:-1]} {token[-1]}" for token in tokens if len(token) > 1]
    return tokens, types, merges


def _numpy(tensor) -> np.ndarray:
    return np.ascontiguousarray(tensor.detach().float().cpu().numpy())


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """Our GPT's weights under llama.cpp's `gpt2` tensor names, each (out, in) as torch stores it (GGUF's numpy
    order: llama.cpp reads it as ne = (in, out))."""
    from gguf import MODEL_TENSOR, TENSOR_NAMES

    def name(tensor: MODEL_TENSOR, kind: str, block: int | None = None) -> str:
        base = TENSOR_NAMES[tensor]
        return (base.format(bid=block) if block is not None else base) + f".{kind}"

    def both(tensor: MODEL_TENSOR, module, block: int | None = None) -> dict[str, np.ndarray]:
        return {name(tensor, "weight", block): _numpy(module.weight), name(tensor, "bias", block): _numpy(module.bias)}

    tensors = {name(MODEL_TENSOR.TOKEN_EMBD, "weight"): _numpy(model.token_embedding.weight),
               name(MODEL_TENSOR.POS_EMBD, "weight"): _numpy(model.position_embedding.weight)}
    for i, block in enumerate(model.blocks):
        attention = block.attn
        projections = (attention.q_proj, attention.k_proj, attention.v_proj)
        tensors |= both(MODEL_TENSOR.ATTN_NORM, block.norm1, i)
        tensors[name(MODEL_TENSOR.ATTN_QKV, "weight", i)] = np.concatenate([_numpy(p.weight) for p in projections])
        tensors[name(MODEL_TENSOR.ATTN_QKV, "bias", i)] = np.concatenate([_numpy(p.bias) for p in projections])
        tensors |= both(MODEL_TENSOR.ATTN_OUT, attention.out_proj, i)
        tensors |= both(MODEL_TENSOR.FFN_NORM, block.norm2, i)
        tensors |= both(MODEL_TENSOR.FFN_UP, block.ff.up, i)
        tensors |= both(MODEL_TENSOR.FFN_DOWN, block.ff.down, i)
    tensors |= both(MODEL_TENSOR.OUTPUT_NORM, model.norm)
    return tensors


def write_gguf(model, path: Path, file_type: str = "f32") -> Path:
    """Write our GPT `model` as a GGUF file of llama.cpp's `gpt2` architecture at `path` (see the module's
    docstring); written under a temporary name first, so a file at `path` is always complete."""
    from gguf import GGUFWriter
    from gguf.quants import quantize

    config = model.config
    if config.activation != "gelu":
        raise NotImplementedError(f"activation {config.activation!r}: llama.cpp's gpt2 graph applies GELU")
    ftype, quantization = file_types()[file_type]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(str(partial), ARCHITECTURE)
    writer.add_name(f"transformer-serving gpt (random weights, seed 0, {file_type})")
    writer.add_file_type(int(ftype))
    writer.add_context_length(config.context_length)
    writer.add_embedding_length(config.d_model)
    writer.add_block_count(config.n_layers)
    writer.add_feed_forward_length(config.d_ff)
    writer.add_head_count(config.n_heads)
    writer.add_layer_norm_eps(LAYER_NORM_EPSILON)
    tokens, types, merges = vocabulary(config.vocab_size, config.eos_id)
    writer.add_tokenizer_model(TOKENIZER_MODEL)
    writer.add_tokenizer_pre(TOKENIZER_PRE)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(config.eos_id)
    writer.add_pad_token_id(PAD_ID)
    writer.add_add_bos_token(False)
    for name, array in gguf_tensors(model).items():
        if quantization is not None and name.endswith(QUANTIZED):
            writer.add_tensor(name, quantize(array, quantization), raw_dtype=quantization)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(path)
    return path


def convert(spec: GptSpec, workdir: Path, file_type: str = "f32") -> Path:
    """The GGUF file of our GPT at `spec` (seed 0), written once into workdir (the folder name carries the spec)."""
    path = spec_dir(workdir, f"llama-cpp-gpt-{file_type}", spec) / GGUF_FILE
    if not path.exists():
        write_gguf(gpt_model(spec), path, file_type)
    return path


def binary(name: str) -> Path:
    """A llama.cpp program of `make llama-cpp`'s build; NotImplementedError while it is not built (the bench then
    reports the system as skipped, with this reason)."""
    path = BUILD_BIN / name
    if not os.access(path, os.X_OK):
        raise NotImplementedError(NOT_BUILT)
    return path


def version() -> str | None:
    """The build's version line (`--version`), or None while it is not built."""
    try:
        path = binary(BATCHED_BENCH)
    except NotImplementedError:
        return None
    done = subprocess.run([str(path), "--version"], capture_output=True, text=True, check=False)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")]
    return lines[0] if lines else None


def _environment() -> dict[str, str]:
    """A child's environment: the bench's, less OMP_WAIT_POLICY (llama.cpp keeps its own wait policy)."""
    return {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def repack_options(model: Path) -> list[str]:
    """The options every llama.cpp command on `model` gets: none, or `--no-repack` when a tiny llama-batched-bench
    run with llama.cpp's defaults dies of an illegal instruction (`NO_REPACK`); probed once per file."""
    if model not in _REPACK_OPTIONS:
        probe = [str(binary(BATCHED_BENCH)), "-m", str(model), "-c", "64", "-npp", "2", "-ntg", "1", "-npl", "1",
                 "-t", "1"]
        done = subprocess.run(probe, capture_output=True, text=True, env=_environment(), check=False)
        _REPACK_OPTIONS[model] = [NO_REPACK] if done.returncode in ILLEGAL_INSTRUCTION else []
        if _REPACK_OPTIONS[model]:
            print(f"    llama.cpp on {model.parent.name}: its default (repacked weights) died of SIGILL; running it "
                  f"with {NO_REPACK}", flush=True)
    return _REPACK_OPTIONS[model]


def completion_fields(new_tokens: int) -> dict:
    """What every request to llama-server asks besides its prompt: greedy, exactly `new_tokens` tokens (EOS
    masked), no prompt caching across requests (each runs its prompt pass, as ours does)."""
    return {"n_predict": new_tokens, "ignore_eos": True, "cache_prompt": False, **GREEDY}


class Server:
    """One `llama-server` on `model` with `slots` parallel slots of `context_length` tokens each, all decoded
    together (continuous batching), on a free local port; its log goes to `log`. Started stopped (SIGSTOP) once it
    is healthy: `resume()` before using it, `pause()` after (`complete` does both)."""

    name = SERVER

    def __init__(self, model: Path, context_length: int, runtime: Runtime, slots: int, log: Path):
        self.slots, self.port, self.log_path = slots, _free_port(), log
        self.command = [str(binary(SERVER)), "-m", str(model), "--host", HOST, "--port", str(self.port),
                        "-t", str(runtime.threads), "-tb", str(runtime.threads), "-np", str(slots), "--cont-batching",
                        "-c", str(slots * context_length), "-ctk", KV_CACHE_TYPE, "-ctv", KV_CACHE_TYPE,
                        "--cache-ram", "0", "--no-webui", *repack_options(model)]
        self.environment = _environment()
        self.log = log.open("w")
        started = time.monotonic()
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env=self.environment)
        atexit.register(self.close)
        deadline = started + SERVER_START_TIMEOUT_S
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"llama-server did not start (exit {self.process.returncode}): see {log}")
            time.sleep(SERVER_POLL_S)
        self.ready_seconds = time.monotonic() - started
        self.pause()  # until it is used (`complete`, or a client's `resume`)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def send_signal(self, signum: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def pause(self) -> None:
        """SIGSTOP: its threads take no core from the systems timed meanwhile."""
        self.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.send_signal(signal.SIGCONT)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection(HOST, self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            payload = None if body is None else json.dumps(body)
            connection.request(method, path, payload, {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def _healthy(self) -> bool:
        try:
            return self._request("GET", "/health")[0] == http.client.OK
        except OSError:
            return False

    def complete(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        """Greedy continuations of `prompts` (token ids), exactly `new_tokens` each, in the prompts' order."""
        body = {"prompt": prompts, "return_tokens": True, "stream": False, **completion_fields(new_tokens)}
        self.resume()
        try:
            status, content = self._request("POST", "/completion", body)
        finally:  # stopped between its passes: its threads must not take the cores from the systems timed meanwhile
            self.pause()
        if status != http.client.OK:
            raise RuntimeError(f"llama-server /completion answered {status}: {content[:500]!r}")
        results = json.loads(content)
        results = results if isinstance(results, list) else [results]  # one prompt: one object
        return [result["tokens"] for result in sorted(results, key=lambda r: r.get("index", 0))]

    def close(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after STOP_TIMEOUT_S); again does nothing."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def run_llama_cpp_gpt(spec: GptSpec, runtime: Runtime, workdir: Path, file_type: str = "f32") -> GenerateFn:
    """LLAMA.CPP, GPT: `llama-server`'s /completion on our GPT's weights (random, seed 0, as ours) converted to GGUF
    (untimed, cached). `generate(prompts)`: prompts (B, spec.prompt_tokens) int64 -> (B, spec.new_tokens) int64,
    greedy, EOS masked, all B rows in one request on a server of B slots (started afresh when B changes, so in the
    bench's untimed warm-up). See the module's docstring for what is alike and what differs."""
    binary(SERVER)  # NotImplementedError (skipped) before anything is converted
    model = convert(spec, workdir, file_type)
    log = model.with_name("llama-server.log")
    servers: list[Server] = []

    def generate(prompts: np.ndarray) -> np.ndarray:
        batch = prompts.shape[0]
        if not servers or servers[0].slots != batch:
            if servers:
                servers.pop().close()
            servers.append(Server(model, spec.context_length, runtime, batch, log))
        return np.array(servers[0].complete(prompts.tolist(), spec.new_tokens), dtype=np.int64)

    return generate


def parse_batched_bench(output: str) -> list[dict]:
    """The rows of llama-batched-bench's printed table (its default, markdown output): one dict per row, keyed by
    `BATCHED_BENCH_COLUMNS` (pp, tg, batch, n_kv: ints; t_pp, t_tg, t: seconds; speed_pp, speed_tg, speed: tokens/s)."""
    header, rows = None, []
    for line in output.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if header is None:
            if "S_TG t/s" in cells:
                header = [BATCHED_BENCH_COLUMNS[cell] for cell in cells]
            continue
        if len(cells) != len(header) or set(cells[0]) <= {"-"}:  # the separator row
            continue
        row = dict(zip(header, cells))
        rows.append({key: int(value) if key in INTEGER_COLUMNS else float(value) for key, value in row.items()})
    return rows


def batched_bench(spec: GptSpec, runtime: Runtime, workdir: Path, batch: int, repeats: int,
                  file_type: str = "f32") -> dict:
    """llama.cpp's own benchmark on the same GGUF: `llama-batched-bench` with `batch` sequences of
    `spec.prompt_tokens` prompt tokens (each its own prompt pass) and `spec.new_tokens` decoding steps, the bench's
    threads and KV cache type, run `repeats` times (a process each, after its own warm-up). It feeds random tokens
    and computes the logits of every step, but samples nothing: no sampling, no HTTP, no tokens out. Returned: the
    medians of its generation speed S_TG (`speed_tg`: tokens/s over the decoding steps alone) and of
    `tokens_per_s`, generated tokens over its prompt pass plus decoding time (what the bench's tokens/s counts),
    and every run's row."""
    model = convert(spec, workdir, file_type)
    command = [str(binary(BATCHED_BENCH)), "-m", str(model), "-c", str(batch * spec.context_length),
               "-npp", str(spec.prompt_tokens), "-ntg", str(spec.new_tokens), "-npl", str(batch),
               "-t", str(runtime.threads), "-tb", str(runtime.threads), "-ctk", KV_CACHE_TYPE, "-ctv", KV_CACHE_TYPE,
               *repack_options(model)]
    runs = []
    for _ in range(repeats):
        for attempt in range(BATCHED_BENCH_ATTEMPTS):
            done = subprocess.run(command, capture_output=True, text=True, env=_environment(), check=False)
            rows = parse_batched_bench(done.stdout + "\n" + done.stderr)
            if done.returncode == 0 and len(rows) == 1:
                break
        else:
            raise RuntimeError(f"llama-batched-bench failed (exit {done.returncode}, {BATCHED_BENCH_ATTEMPTS} "
                               f"attempts): {done.stdout[-1000:]} {done.stderr[-1000:]}")
        runs.append(rows[0])
    return {"batch": batch, "tokens_per_s": statistics.median(r["batch"] * r["tg"] / r["t"] for r in runs),
            "speed_tg": statistics.median(r["speed_tg"] for r in runs), "runs": runs}


def batched_bench_names(file_type: str = "f32") -> tuple[str, str]:
    """(the result's key, the ratios' peer name) of llama-batched-bench's row on the GGUF of `file_type`: f32's
    `llama_cpp_batched_bench` / `llama-batched-bench`, q8_0's `..._q8_0` / `llama-batched-bench-q8_0`."""
    suffix = "" if file_type == "f32" else f"_{file_type}"
    return f"llama_cpp_batched_bench{suffix}", "llama-batched-bench" + suffix.replace("_", "-", 1)


def add_batched_bench(result: dict, spec: GptSpec, runtime: Runtime, workdir: Path, batch: int, repeats: int,
                      file_type: str = "f32") -> None:
    """Add llama-batched-bench's row at `batch` on the GGUF of `file_type` to a GPT case's `result` (`summarise`'s),
    with the ratios `<ours|shipped>/<peer>` of our tokens/s to its `tokens_per_s` (both count the prompt pass;
    `batched_bench_names`)."""
    key, peer = batched_bench_names(file_type)
    try:
        row = result[key] = batched_bench(spec, runtime, workdir, batch, repeats, file_type)
    except RuntimeError as error:  # its own row only: the timed systems' results stand
        result[key] = {"batch": batch, "error": str(error)}
        print(f"    {peer}: {error}", flush=True)
        return
    for mine in ("ours", "shipped"):
        if mine in result["systems"]:
            ours = result["systems"][mine]["throughput"]
            result["ratios"][f"{mine}/{peer}"] = ours / row["tokens_per_s"]


def first_divergence(a: np.ndarray, b: np.ndarray) -> int:
    """The index of the first token where `a` and `b` differ; their length when they are identical."""
    different = np.flatnonzero(np.asarray(a) != np.asarray(b))
    return int(different[0]) if different.size else len(a)


def agreement(ours: list[np.ndarray], theirs: list[np.ndarray]) -> dict:
    """How far llama.cpp's greedy continuations follow ours on the same prompts (lists of (B, new_tokens) outputs,
    as `measure` returns them): identical sequences, identical tokens, and each sequence's first divergence (the
    tokens before it are all equal; after it the two continue from different contexts)."""
    pairs = [(a, b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
    first = [first_divergence(a, b) for a, b in pairs]
    return {"identical_sequences": sum(f == len(a) for f, (a, _) in zip(first, pairs)), "sequences": len(pairs),
            "identical_tokens": int(sum(int((a == b).sum()) for a, b in pairs)),
            "tokens": int(sum(a.size for a, _ in pairs)), "first_divergence": first}
