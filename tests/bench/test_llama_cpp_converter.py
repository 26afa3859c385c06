"""The engine benchmark's llama.cpp peer runs OUR GPT's weights (bench/enginebench/llama_cpp.py), and these tests
need no llama.cpp build: the GGUF file it writes, read back with gguf's own GGUFReader, holds every tensor of our
model under llama.cpp's `gpt2` names, shapes and values (q8_0 within its rounding), the hyper-parameters llama.cpp
reads, and a vocabulary of the ids themselves; computed as llama.cpp's gpt2 graph computes (src/models/gpt2.cpp,
re-done here in numpy from the file's tensors: fused QKV split in order, heads, tied head), it gives our model's
logits, up to GELU's tanh approximation. Also: llama-batched-bench's table parsed from a sample of its real output,
the agreement summary, and the system skipped with its reason while llama.cpp is not built."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from tests.support import ROOT

BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from gguf import GGMLQuantizationType, GGUFReader, TokenType  # noqa: E402 - the dev extra's
from gguf.quants import dequantize  # noqa: E402

from enginebench import llama_cpp  # noqa: E402 - after the sys.path set-up
from enginebench.systems import build_systems  # noqa: E402
from enginebench.workloads import BOS_ID, EOS_ID, PAD_ID, GptSpec, Runtime, make_prompts  # noqa: E402

from models.config import GPTConfig  # noqa: E402
from models.gpt import GPT  # noqa: E402

SPEC = GptSpec(vocab_size=120, d_model=32, n_layers=2, n_heads=4, d_ff=64, context_length=24, prompt_tokens=6,
               new_tokens=8)
EPSILON = 1e-5
# our exact (erf) GELU against llama.cpp's tanh approximation, on this model's small activations: the logits differ
# by float32 rounding and the approximation's few 1e-6 (measured: 8e-7)
LOGITS_ATOL = 1e-5
Q8_0_BLOCK = 32  # q8_0: blocks of 32 weights, one scale each (max |w| / 127)

# llama-batched-bench's real output (this build, on the bench's GGUF: -c 512 -npp 16 -ntg 8 -npl 1,2 -t 2 -tb 2
# -ctk f32 -ctv f32; its stdout, the default printed table that parse_batched_bench reads)
BATCHED_BENCH_SAMPLE = """
llama_batched_bench: n_kv_max = 512, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |      8 |    1 |     24 |    0.008 |  2009.04 |    0.028 |   287.43 |    0.036 |   670.45 |
|    16 |      8 |    2 |     48 |    0.017 |  1875.51 |    0.084 |   191.40 |    0.101 |   476.87 |

"""


@pytest.fixture(scope="module")
def model():
    return llama_cpp.gpt_model(SPEC)


@pytest.fixture(scope="module")
def reader(model, tmp_path_factory):
    return GGUFReader(str(llama_cpp.write_gguf(model, tmp_path_factory.mktemp("gguf") / "model.gguf")))


def field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


def numpy(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().numpy()


def expected_tensors(model) -> dict[str, np.ndarray]:
    """Our model's weights as llama.cpp's gpt2 loader names them, spelled out here by hand (torch's (out, in))."""
    tensors = {"token_embd.weight": numpy(model.token_embedding.weight),
               "position_embd.weight": numpy(model.position_embedding.weight),
               "output_norm.weight": numpy(model.norm.weight), "output_norm.bias": numpy(model.norm.bias)}
    for i, block in enumerate(model.blocks):
        attention = block.attn
        parts = {"attn_norm": block.norm1, "attn_output": attention.out_proj, "ffn_norm": block.norm2,
                 "ffn_up": block.ff.up, "ffn_down": block.ff.down}
        for name, module in parts.items():
            tensors[f"blk.{i}.{name}.weight"] = numpy(module.weight)
            tensors[f"blk.{i}.{name}.bias"] = numpy(module.bias)
        tensors[f"blk.{i}.attn_qkv.weight"] = numpy(torch.cat(
            [attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]))
        tensors[f"blk.{i}.attn_qkv.bias"] = numpy(torch.cat(
            [attention.q_proj.bias, attention.k_proj.bias, attention.v_proj.bias]))
    return tensors


def test_every_tensor_is_our_weight_under_llama_cpps_name_and_shape(model, reader):
    expected = expected_tensors(model)
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == set(expected)  # no `output.weight`: llama.cpp ties the head to token_embd, as ours is
    for name, weight in expected.items():
        tensor = tensors[name]
        assert tensor.tensor_type == GGMLQuantizationType.F32, name
        assert list(tensor.shape) == list(reversed(weight.shape)), name  # GGUF's ne: (in, out)
        np.testing.assert_array_equal(tensor.data, weight, err_msg=name)


def test_the_hyper_parameters_are_our_models(model, reader):
    config = model.config
    assert field(reader, "general.architecture") == "gpt2"
    assert field(reader, "gpt2.context_length") == config.context_length == SPEC.context_length
    assert field(reader, "gpt2.embedding_length") == config.d_model
    assert field(reader, "gpt2.block_count") == config.n_layers
    assert field(reader, "gpt2.feed_forward_length") == config.d_ff
    assert field(reader, "gpt2.attention.head_count") == config.n_heads
    assert field(reader, "gpt2.attention.layer_norm_epsilon") == pytest.approx(EPSILON)
    assert all(norm.eps == EPSILON for block in model.blocks for norm in (block.norm1, block.norm2))
    assert model.norm.eps == EPSILON and config.activation == "gelu"


def test_the_vocabulary_is_the_ids_with_our_special_ids(reader):
    tokens = field(reader, "tokenizer.ggml.tokens")
    assert tokens == [str(i) for i in range(SPEC.vocab_size)]
    assert field(reader, "tokenizer.ggml.model") == "gpt2" and field(reader, "tokenizer.ggml.pre") == "default"
    types = field(reader, "tokenizer.ggml.token_type")
    special = (PAD_ID, BOS_ID, EOS_ID)
    assert [i for i, kind in enumerate(types) if kind == TokenType.CONTROL] == list(special)
    assert all(kind == TokenType.NORMAL for i, kind in enumerate(types) if i not in special)
    assert (field(reader, "tokenizer.ggml.bos_token_id"), field(reader, "tokenizer.ggml.eos_token_id"),
            field(reader, "tokenizer.ggml.padding_token_id")) == (BOS_ID, EOS_ID, PAD_ID)
    assert field(reader, "tokenizer.ggml.add_bos_token") is False
    # the merges llama.cpp's BPE loader requires: each spells a token from two tokens, every longer token once
    merges = [merge.split(" ") for merge in field(reader, "tokenizer.ggml.merges")]
    vocabulary = set(tokens)
    assert all(len(pair) == 2 and set(pair) <= vocabulary and "".join(pair) in vocabulary for pair in merges)
    assert sorted("".join(pair) for pair in merges) == sorted(t for t in tokens if len(t) > 1)


def test_the_eos_is_the_models_own(tmp_path):
    # bench_http's llama-server serves the byte-level GPT, whose EOS is <|endoftext|> (256), not EOS_ID (a byte there)
    config = GPTConfig(vocab_size=257, context_length=16, d_model=16, n_heads=2, n_layers=1, d_ff=32, dropout=0.0)
    assert config.eos_id == 256
    reader = GGUFReader(str(llama_cpp.write_gguf(GPT(config).eval(), tmp_path / "model.gguf")))
    assert field(reader, "tokenizer.ggml.eos_token_id") == 256
    types = field(reader, "tokenizer.ggml.token_type")
    assert types[256] == TokenType.CONTROL and types[EOS_ID] == TokenType.NORMAL


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    variance = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(variance + EPSILON) * weight + bias


def gelu_tanh(x: np.ndarray) -> np.ndarray:  # ggml_gelu
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * x * (1.0 + 0.044715 * x * x)))


def gpt2_logits(reader: GGUFReader, ids: list[int]) -> np.ndarray:
    """llama.cpp's gpt2 graph (src/models/gpt2.cpp) on the file's tensors, one sequence, in float64."""
    t = {tensor.name: np.asarray(tensor.data, np.float64) for tensor in reader.tensors}
    heads = field(reader, "gpt2.attention.head_count")
    d = field(reader, "gpt2.embedding_length")
    head_dim, n = d // heads, len(ids)
    x = t["token_embd.weight"][ids] + t["position_embd.weight"][:n]
    causal = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(field(reader, "gpt2.block_count")):
        h = layer_norm(x, t[f"blk.{i}.attn_norm.weight"], t[f"blk.{i}.attn_norm.bias"])
        qkv = h @ t[f"blk.{i}.attn_qkv.weight"].T + t[f"blk.{i}.attn_qkv.bias"]
        q, k, v = (part.reshape(n, heads, head_dim).transpose(1, 0, 2) for part in np.split(qkv, 3, axis=-1))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(head_dim) + causal
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        attended = (weights / weights.sum(-1, keepdims=True)) @ v
        x = x + attended.transpose(1, 0, 2).reshape(n, d) @ t[f"blk.{i}.attn_output.weight"].T \
            + t[f"blk.{i}.attn_output.bias"]
        h = layer_norm(x, t[f"blk.{i}.ffn_norm.weight"], t[f"blk.{i}.ffn_norm.bias"])
        up = gelu_tanh(h @ t[f"blk.{i}.ffn_up.weight"].T + t[f"blk.{i}.ffn_up.bias"])
        x = x + up @ t[f"blk.{i}.ffn_down.weight"].T + t[f"blk.{i}.ffn_down.bias"]
    x = layer_norm(x, t["output_norm.weight"], t["output_norm.bias"])
    return x @ t["token_embd.weight"].T  # the tied head


def test_the_file_computed_as_llama_cpps_gpt2_graph_gives_our_logits(model, reader):
    for prompt in make_prompts(SPEC, 3).tolist():
        with torch.no_grad():
            ours, _ = model(torch.tensor([prompt]))
        np.testing.assert_allclose(gpt2_logits(reader, prompt), ours[0].numpy(), atol=LOGITS_ATOL)


def test_q8_0_quantizes_the_matmul_weights_only(model, tmp_path):
    quantized = GGUFReader(str(llama_cpp.write_gguf(model, tmp_path / "q8.gguf", "q8_0")))
    expected = expected_tensors(model)
    assert {t.name for t in quantized.tensors} == set(expected)
    for tensor in quantized.tensors:
        weight = expected[tensor.name]
        if tensor.name.endswith(llama_cpp.QUANTIZED):
            assert tensor.tensor_type == GGMLQuantizationType.Q8_0, tensor.name
            values = dequantize(tensor.data, tensor.tensor_type).reshape(weight.shape)
            scale = np.abs(weight.reshape(-1, Q8_0_BLOCK)).max(-1, keepdims=True) / 127
            error = np.abs(values - weight).reshape(-1, Q8_0_BLOCK)
            assert (error <= scale).all(), tensor.name  # within one step of its block's scale
        else:
            assert tensor.tensor_type == GGMLQuantizationType.F32, tensor.name
            np.testing.assert_array_equal(tensor.data, weight, err_msg=tensor.name)


def test_the_batched_bench_table_is_parsed_from_its_real_output():
    first, second = llama_cpp.parse_batched_bench(BATCHED_BENCH_SAMPLE)
    assert first == {"pp": 16, "tg": 8, "batch": 1, "n_kv": 24, "t_pp": 0.008, "speed_pp": 2009.04, "t_tg": 0.028,
                     "speed_tg": 287.43, "t": 0.036, "speed": 670.45}
    assert (second["batch"], second["n_kv"], second["t"], second["speed_tg"]) == (2, 48, 0.101, 191.40)
    assert llama_cpp.parse_batched_bench("no table here\n") == []


def test_batched_bench_rows_run_on_each_file_type_and_name_their_ratios(monkeypatch, tmp_path):
    """bench-engine adds llama-batched-bench's row per llama.cpp system in the run: on the f32 GGUF under
    `llama_cpp_batched_bench` (ratios `<mine>/llama-batched-bench`), on the q8_0 one under
    `llama_cpp_batched_bench_q8_0` (`<mine>/llama-batched-bench-q8_0`); a failure stays in its own row."""
    asked = []

    def fake(spec, runtime, workdir, batch, repeats, file_type="f32"):
        asked.append(file_type)
        if file_type == "broken":
            raise RuntimeError("exit 1")
        return {"batch": batch, "tokens_per_s": {"f32": 100.0, "q8_0": 250.0}[file_type], "speed_tg": 1.0,
                "runs": []}

    monkeypatch.setattr(llama_cpp, "batched_bench", fake)
    result = {"systems": {"ours": {"throughput": 200.0}, "shipped": {"throughput": 300.0}}, "ratios": {}}
    llama_cpp.add_batched_bench(result, SPEC, Runtime(), tmp_path, 16, 1)
    llama_cpp.add_batched_bench(result, SPEC, Runtime(), tmp_path, 16, 1, "q8_0")
    assert asked == ["f32", "q8_0"]
    assert result["llama_cpp_batched_bench"]["tokens_per_s"] == 100.0
    assert result["llama_cpp_batched_bench_q8_0"]["tokens_per_s"] == 250.0
    assert result["ratios"] == {"ours/llama-batched-bench": 2.0, "shipped/llama-batched-bench": 3.0,
                                "ours/llama-batched-bench-q8_0": 0.8, "shipped/llama-batched-bench-q8_0": 1.2}
    llama_cpp.add_batched_bench(result, SPEC, Runtime(), tmp_path, 16, 1, "broken")
    assert result["llama_cpp_batched_bench_broken"] == {"batch": 16, "error": "exit 1"}
    assert len(result["ratios"]) == 4


@pytest.mark.parametrize(("script", "options"), [("kill -ILL $$", ["--no-repack"]), ("exit 0", []),
                                                  ("exit 1", [])])
def test_no_repack_only_where_llama_cpp_dies_of_an_illegal_instruction(monkeypatch, tmp_path, script, options):
    """llama.cpp's AMX kernels (repacked weights) die of SIGILL on some AMX hosts: each GGUF is probed once with a
    tiny llama-batched-bench run, and only a death by SIGILL adds `--no-repack` to its commands; any other failure
    is left for the real run to report."""
    fake = tmp_path / "bin"
    fake.mkdir()
    probe = fake / llama_cpp.BATCHED_BENCH
    probe.write_text(f"#!/bin/sh\necho run >> {tmp_path / 'runs'}\n{script}\n")
    probe.chmod(0o755)
    monkeypatch.setattr(llama_cpp, "BUILD_BIN", fake)
    monkeypatch.setattr(llama_cpp, "_REPACK_OPTIONS", {})
    model = tmp_path / "model.gguf"
    assert llama_cpp.repack_options(model) == options
    assert llama_cpp.repack_options(model) == options
    assert (tmp_path / "runs").read_text() == "run\n"  # probed once per file


def test_agreement_counts_identical_sequences_and_tokens_and_where_each_first_diverges():
    ours = [np.array([[5, 6, 7, 8], [5, 6, 7, 8]]), np.array([[9, 9, 9, 9]])]
    theirs = [np.array([[5, 6, 7, 8], [5, 6, 4, 8]]), np.array([[3, 9, 9, 9]])]
    assert llama_cpp.agreement(ours, theirs) == {"identical_sequences": 1, "sequences": 3, "identical_tokens": 10,
                                                 "tokens": 12, "first_divergence": [4, 2, 0]}


def test_the_q8_0_system_runs_llama_cpp_on_a_q8_0_file_beside_the_f32_ones(monkeypatch, tmp_path):
    """bench-engine's `llama.cpp-q8_0` converts our GPT to a GGUF whose matmul weights are q8_0 (the f32 system's:
    all f32), each into its own folder; built, not started (a server starts at the first pass): a stand-in binary."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / llama_cpp.SERVER).write_text("#!/bin/sh\nexit 1\n")
    (fake / llama_cpp.SERVER).chmod(0o755)
    monkeypatch.setattr(llama_cpp, "BUILD_BIN", fake)
    built, skipped = build_systems("gpt", SPEC, ["llama.cpp", "llama.cpp-q8_0"], Runtime(), tmp_path / "work")
    assert set(built) == {"llama.cpp", "llama.cpp-q8_0"} and skipped == {}
    for file_type in ("f32", "q8_0"):
        (path,) = (tmp_path / "work").glob(f"llama-cpp-gpt-{file_type}*/{llama_cpp.GGUF_FILE}")
        reader = GGUFReader(str(path))
        assert field(reader, "general.file_type") == llama_cpp.file_types()[file_type][0]
        types = {t.name: t.tensor_type for t in reader.tensors}
        expected = GGMLQuantizationType.Q8_0 if file_type == "q8_0" else GGMLQuantizationType.F32
        assert {types[name] for name in types if name.endswith(llama_cpp.QUANTIZED)} == {expected}, file_type
        assert {types[name] for name in types if not name.endswith(llama_cpp.QUANTIZED)} == {GGMLQuantizationType.F32}


def test_without_a_build_the_bench_skips_llama_cpp_with_the_make_target(monkeypatch, tmp_path):
    monkeypatch.setattr(llama_cpp, "BUILD_BIN", tmp_path / "absent")
    with pytest.raises(NotImplementedError, match=r"run `make llama-cpp`"):
        llama_cpp.run_llama_cpp_gpt(SPEC, Runtime(), tmp_path)
    built, skipped = build_systems("gpt", SPEC, ["llama.cpp"], Runtime(), tmp_path)
    assert built == {} and skipped == {"llama.cpp": f"NotImplementedError: {llama_cpp.NOT_BUILT}"}
    assert not list(tmp_path.iterdir())  # nothing converted for a system that cannot run
    assert llama_cpp.version() is None
