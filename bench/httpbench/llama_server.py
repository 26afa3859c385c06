"""The GPT's C++ peer over HTTP: `llama-server`, started as bench-engine starts it (bench/enginebench/llama_cpp.py's
`Server`), on the served GPT's weights, and the gpt case's requests for it.

- Weights: the repository's GPT rebuilt in PyTorch (`repository.random_model`: the same preset and seed as the
  exported one) and written as GGUF by `llama_cpp.write_gguf`, once per repository (its folder name carries the
  models' source digest) and file type: f32 for the `llama-server` case, q8_0 (llama.cpp's int8 format, the peer of
  the service's int8 variants, issue 56) for `llama-server-q8_0` (`SERVERS`); llama.cpp's default f16 KV cache.
- The server: as many slots as the most concurrent streams, all decoded together (continuous batching), the
  benchmark's threads, no prompt cache; stopped (SIGSTOP) except while its own cases run (`servers.run_alone`).
- The requests: the gpt case's screened prompts as the token ids the service feeds its GPT (its /tokenize; the
  GGUF's vocabulary is the ids themselves, so llama-server is given no text), streamed from OpenAI's
  `/v1/completions` (server-sent events ending with [DONE], as the service's /v1/generate), greedy, exactly
  max_new_tokens tokens (EOS masked: the screened prompts do not reach it on the service either), read by the same
  client (`load.send_stream`, with `load.completion_chunk_event`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from enginebench import llama_cpp
from enginebench.workloads import Runtime

from .load import Workload, completion_chunk_event
from .repository import random_model

COMPLETIONS_PATH = "/v1/completions"
JSON_HEADERS = {"content-type": "application/json"}


class Peer(NamedTuple):
    """One llama-server peer: its GGUF's weights (`llama_cpp.file_types`) and its cases' name before ` c=<streams>`
    (at most 13 characters: the tables' case column)."""

    file_type: str
    case: str


F32 = "llama-server"  # the --cases entry of the f32 peer, as bench-engine's llama.cpp rows
SERVERS = {F32: Peer("f32", "llama-server"), "llama-server-q8_0": Peer("q8_0", "llama-q8_0")}  # by --cases entry


def case_name(streams: int, option: str = F32) -> str:
    return f"{SERVERS[option].case} c={streams}"


def gguf_file(repository: Path, workdir: Path, file_type: str = SERVERS[F32].file_type) -> Path:
    """The served GPT as a GGUF file of `file_type`, written once per repository into
    workdir/peers/<repository folder>/."""
    path = workdir / "peers" / repository.name / f"llama-cpp-gpt-{file_type}" / llama_cpp.GGUF_FILE
    if not path.exists():
        llama_cpp.write_gguf(random_model("gpt"), path, file_type)
    return path


def llama_server(args, repository: Path, context_length: int, slots: int, option: str = F32) -> llama_cpp.Server:
    """llama-server on the served GPT in the file type of the --cases entry `option` (`gguf_file`, `SERVERS`),
    named `option`, with `slots` slots of `context_length` tokens, the benchmark's threads, its log in
    workdir/logs/<option>.log; started stopped (the caller runs it alone when measured). NotImplementedError
    (`llama_cpp.NOT_BUILT`: run `make llama-cpp`) while llama.cpp is not built, before anything is converted;
    RuntimeError when it does not start."""
    llama_cpp.binary(llama_cpp.SERVER)
    model = gguf_file(repository, args.workdir, SERVERS[option].file_type)
    log = args.workdir / "logs" / f"{option}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    server = llama_cpp.Server(model, context_length, Runtime(threads=args.threads, spin=args.spin), slots, log)
    server.name = option  # the JSON report's record of it
    return server


def completion_request(prompt: list[int], max_new_tokens: int) -> dict:
    """One streamed `/v1/completions` request: the prompt's token ids and bench-engine's fields (greedy, exactly
    `max_new_tokens` tokens, no prompt cache)."""
    return {"prompt": prompt, "stream": True, **llama_cpp.completion_fields(max_new_tokens)}


def llama_server_workload(prompts: list[list[int]], max_new_tokens: int) -> Workload:
    """The gpt case's requests (prompts as token ids) for llama-server; work = the tokens streamed."""
    bodies = [json.dumps(completion_request(prompt, max_new_tokens)).encode() for prompt in prompts]
    return Workload(COMPLETIONS_PATH, bodies, JSON_HEADERS, stream=True, unit="tokens/s", events=completion_chunk_event)
