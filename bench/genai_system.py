"""ONNX Runtime GenAI as a system of bench/bench_engine.py: our own exported GPT graph, run by `onnxruntime_genai`.

GenAI runs the very file our engine loads (`decoder.onnx`, exported by `export.onnx_export.export_gpt`, unchanged):
its folder here holds only a generated `genai_config.json` and a symlink to that file. The graph already has the
interface GenAI's "decoder" model type expects (service/engines/onnx_schema.py follows GenAI's and Optimum's convention):
`input_ids`, `position_ids`, `attention_mask` (int64, the whole past + new length), `past_key_values.{i}.key/value`
in and `logits`, `present.{i}.key/value` out, caches (batch, heads, sequence, head_dim). The config names them
anyway (`inputs` / `outputs`), so nothing rests on GenAI's defaults. The cache grows by concatenation in the graph,
so `past_present_share_buffer` is false (GenAI feeds each step's `present.*` back as `past_key_values.*`).

Same rules as the other systems: greedy (`do_sample` false), exactly `new_tokens` new tokens per row
(`min_length == max_length == prompt + new_tokens`: GenAI's `min_length` counts the whole sequence and masks EOS
until it is reached), the whole batch decoded together, the harness's thread settings (`intra_op_num_threads`,
`inter_op_num_threads` 1, `session.intra_op.allow_spinning` / `inter_op`, ORT_ENABLE_ALL), CPU provider.

Why in-process and not a subprocess worker in its own venv: the onnxruntime-genai wheel carries no onnxruntime of
its own; it loads the installed `onnxruntime` package's `libonnxruntime.so` (it requires onnxruntime>=1.31.0), so
it shares the bench venv's onnxruntime 1.32.0, the same version as the main .venv and our engine. The harness then
times it like every other system, interleaved round by round in one process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

CONFIG_FILE = "genai_config.json"


def genai_config(version_config: dict[str, Any], graph_file: str, *, threads: int, spin: bool,
                 max_length: int, pad_id: int, bos_id: int) -> dict[str, Any]:
    """The `genai_config.json` for our exported GPT graph, from its model-repository `config.json`
    (`export_gpt`'s description: architecture, special tokens, context length)."""
    from service.engines import onnx_schema as schema
    arch = version_config["architecture"]
    spin_value = "1" if spin else "0"
    past_key, past_value = (name.replace(".0.", ".%d.") for name in schema.past_names(0))
    present_key, present_value = (name.replace(".0.", ".%d.") for name in schema.present_names(0))
    return {
        "model": {
            "type": "decoder",
            "vocab_size": arch["vocab_size"],
            "context_length": version_config["context_length"],
            "bos_token_id": bos_id,
            "eos_token_id": version_config["special_tokens"]["eos_id"],
            "pad_token_id": pad_id,
            "decoder": {
                "filename": graph_file,
                "session_options": {
                    "intra_op_num_threads": threads,
                    "inter_op_num_threads": 1,
                    "graph_optimization_level": "ORT_ENABLE_ALL",
                    "log_severity_level": 3,
                    "session.intra_op.allow_spinning": spin_value,
                    "session.inter_op.allow_spinning": spin_value,
                    "provider_options": [],
                },
                "hidden_size": arch["d_model"],
                "num_attention_heads": arch["n_heads"],
                "num_key_value_heads": arch["n_heads"],
                "num_hidden_layers": arch["n_layers"],
                "head_size": arch["head_dim"],
                "inputs": {
                    "input_ids": schema.INPUT_IDS,
                    "position_ids": schema.POSITION_IDS,
                    "attention_mask": schema.ATTENTION_MASK,
                    "past_key_names": past_key,
                    "past_value_names": past_value,
                },
                "outputs": {
                    "logits": schema.LOGITS,
                    "present_key_names": present_key,
                    "present_value_names": present_value,
                },
            },
        },
        "search": {
            "do_sample": False, "num_beams": 1, "num_return_sequences": 1, "top_k": 1, "top_p": 1.0,
            "temperature": 1.0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
            "max_length": max_length, "min_length": max_length,
            "past_present_share_buffer": False,
        },
    }


def prepare_folder(version_path: Path, version_config: dict[str, Any], folder: Path, **config_args) -> Path:
    """`folder` with a symlink to the engine's own graph file and a fresh `genai_config.json`; checks that the
    link resolves to the very file our engine loads."""
    graph_name = version_config["files"]["decoder"]
    source = (version_path / graph_name).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / graph_name
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(os.path.relpath(source, folder))
    if not os.path.samefile(link, source):
        raise RuntimeError(f"{link} does not resolve to the engine's graph {source}")
    config = genai_config(version_config, graph_name, **config_args)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def make_generate(folder: Path, new_tokens: int) -> Callable[[np.ndarray], np.ndarray]:
    """A GenerateFn: prompts (B, S) int64, equal lengths -> (B, new_tokens) int64, greedy, exactly new_tokens
    (min_length == max_length == S + new_tokens), all B rows in one generator."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))

    def generate(prompts: np.ndarray) -> np.ndarray:
        batch, prompt_length = prompts.shape
        length = prompt_length + new_tokens
        params = og.GeneratorParams(model)
        params.set_search_options(batch_size=batch, max_length=length, min_length=length, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(prompts.astype(np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        return np.stack([np.asarray(generator.get_sequence(row))[prompt_length:] for row in range(batch)]
                        ).astype(np.int64)

    return generate
