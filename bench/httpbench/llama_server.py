"""The GPT's C++ peer over HTTP: `llama-server`, started as bench-engine starts it (bench/enginebench/llama_cpp.py's
`Server`), on the served GPT's weights, and the gpt case's requests for it.

- Weights: the repository's GPT rebuilt in PyTorch (`repository.random_model`: the same preset and seed as the
  exported one) and written as GGUF by `llama_cpp.write_gguf` (f32 weights, llama.cpp's default f16 KV cache), once
  per repository (its folder name carries the models' source digest).
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

from enginebench import llama_cpp
from enginebench.workloads import Runtime

from .load import Workload, completion_chunk_event
from .repository import random_model

COMPLETIONS_PATH = "/v1/completions"
FILE_TYPE = "f32"  # the GGUF's weights, as bench-engine's llama.cpp rows
JSON_HEADERS = {"content-type": "application/json"}
LOG_FILE = "llama-server.log"


def case_name(streams: int) -> str:
    return f"llama-server c={streams}"


def gguf_file(repository: Path, workdir: Path) -> Path:
    """The served GPT as a GGUF file, written once per repository into workdir/peers/<repository folder>/."""
    path = workdir / "peers" / repository.name / f"llama-cpp-gpt-{FILE_TYPE}" / llama_cpp.GGUF_FILE
    if not path.exists():
        llama_cpp.write_gguf(random_model("gpt"), path, FILE_TYPE)
    return path


def llama_server(args, repository: Path, context_length: int, slots: int) -> llama_cpp.Server:
    """llama-server on the served GPT (`gguf_file`) with `slots` slots of `context_length` tokens, the benchmark's
    threads, its log in workdir/logs; started stopped (the caller runs it alone when measured). NotImplementedError
    (`llama_cpp.NOT_BUILT`: run `make llama-cpp`) while llama.cpp is not built, before anything is converted;
    RuntimeError when it does not start."""
    llama_cpp.binary(llama_cpp.SERVER)
    model = gguf_file(repository, args.workdir)
    log = args.workdir / "logs" / LOG_FILE
    log.parent.mkdir(parents=True, exist_ok=True)
    return llama_cpp.Server(model, context_length, Runtime(threads=args.threads, spin=args.spin), slots, log)


def completion_request(prompt: list[int], max_new_tokens: int) -> dict:
    """One streamed `/v1/completions` request: the prompt's token ids and bench-engine's fields (greedy, exactly
    `max_new_tokens` tokens, no prompt cache)."""
    return {"prompt": prompt, "stream": True, **llama_cpp.completion_fields(max_new_tokens)}


def llama_server_workload(prompts: list[list[int]], max_new_tokens: int) -> Workload:
    """The gpt case's requests (prompts as token ids) for llama-server; work = the tokens streamed."""
    bodies = [json.dumps(completion_request(prompt, max_new_tokens)).encode() for prompt in prompts]
    return Workload(COMPLETIONS_PATH, bodies, JSON_HEADERS, stream=True, unit="tokens/s", events=completion_chunk_event)
