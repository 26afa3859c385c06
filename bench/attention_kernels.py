"""One decoding step's attention, two ONNX Runtime CPU kernels, on the served GPT's shape: what the in-place step
graph runs today, `com.microsoft.MultiHeadAttention` over the whole fixed-capacity buffer with the unused slots
masked (`export.kv_inplace`: the new token's keys/values written into their slot by ScatterND before it), against
`com.microsoft.GroupQueryAttention` (kv heads = heads), which writes the new token's keys/values into the shared
buffer itself and attends over each row's own length (`seqlens_k`), as onnxruntime-genai runs its CPU models.

Prints each kernel's median time per call, their ratio and the largest difference between their outputs, for rows
that use `--used` of `--capacity` slots (the new one included); the CPU first.

    .venv/bin/python bench/attention_kernels.py --batch 16 --used 228 --capacity 288

`--step-graph` measures the same swap in a served GPT's real step graph instead: the version as stored against its
`+gqa` variant (`service.engines.step_attention`: each layer's two ScatterND and its MultiHeadAttention replaced by
one GroupQueryAttention when the graph loads; the engine's feeds are unchanged), driven by `GPTEngine.generate`
(greedy, 128 tokens, tinyshakespeare prompts of 16 characters, or of 8 to 100 with `--varied`), interleaved with the version as stored: tokens/s of both, how many greedy sequences are
identical, and whether each row decodes alone as in its batch on the rewritten graph (batch invariance):

    .venv/bin/python bench/attention_kernels.py --step-graph --batches 1,16,64 [--varied]

Measured for issue 23's GPT goals at batch 16 and 64 (docs/benchmarks.md); the `+gqa` variants are offered where
`export.variants` checked them, and chosen by the service where faster (`TSERVE_VARIANT=auto`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from cpuinfo import describe as describe_cpu  # noqa: E402

HEADS, HEAD_DIM = 4, 64  # the served GPT's (models/config.py, gpt release)
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
CALLS_PER_SAMPLE, SAMPLES = 50, 15
NEW_TOKENS, GENERATE_SAMPLES = 128, 5  # --step-graph: tokens a row, interleaved timed runs per batch
PROMPT_CHARS, VARIED_CHARS = 16, (8, 100)  # --step-graph prompts: characters of tinyshakespeare
INVARIANCE_ROWS = 12  # --step-graph: rows decoded alone and together on the rewritten graph


def _value(name: str, element: int, shape: list[int]):
    return helper.make_tensor_value_info(name, element, shape)


def sessions(batch: int, capacity: int, threads: int) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    """(MultiHeadAttention over the masked buffer, GroupQueryAttention over each row's length) sessions."""
    f, width = TensorProto.FLOAT, HEADS * HEAD_DIM
    buffer = [batch, HEADS, capacity, HEAD_DIM]
    mha = helper.make_graph(
        [helper.make_node("MultiHeadAttention", ["q", "k", "v", "", "mask"], ["out"], domain="com.microsoft",
                          num_heads=HEADS)], "mha",
        [_value("q", f, [batch, 1, width]), _value("k", f, buffer), _value("v", f, buffer),
         _value("mask", TensorProto.INT32, [batch, capacity])], [_value("out", f, [batch, 1, width])])
    gqa = helper.make_graph(
        [helper.make_node("GroupQueryAttention", ["q", "k_new", "v_new", "past_k", "past_v", "seqlens_k", "total"],
                          ["out", "present_k", "present_v"], domain="com.microsoft", num_heads=HEADS,
                          kv_num_heads=HEADS)], "gqa",
        [_value("q", f, [batch, 1, width]), _value("k_new", f, [batch, 1, width]),
         _value("v_new", f, [batch, 1, width]), _value("past_k", f, buffer), _value("past_v", f, buffer),
         _value("seqlens_k", TensorProto.INT32, [batch]), _value("total", TensorProto.INT32, [1])],
        [_value("out", f, [batch, 1, width]), _value("present_k", f, buffer), _value("present_v", f, buffer)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return tuple(ort.InferenceSession(helper.make_model(graph, opset_imports=OPSETS).SerializeToString(), options,
                                      providers=["CPUExecutionProvider"]) for graph in (mha, gqa))


def _bind(binding, name: str, array: np.ndarray, output: bool = False) -> None:
    (binding.bind_output if output else binding.bind_input)(name, "cpu", 0, array.dtype, array.shape,
                                                            array.ctypes.data)


def compare_step_graphs(args) -> int:
    """`--step-graph`: the version's step graph as stored against its `+gqa` variant (module docstring)."""
    from service.decoding import GreedySearch
    from service.engines.gpt import GPTEngine
    from service.engines.runtime import RuntimeOptions
    from service.engines.step_attention import GQA
    from service.engines.weights import compute_weights
    from service.repository import ModelRepository

    stored = ModelRepository(args.repository).get("gpt", args.version)
    weights = compute_weights(stored.config.get("weights", "fp32"))
    options = RuntimeOptions(intra_op_threads=args.threads, single_thread_rows=1)
    engines = {"mha": GPTEngine(stored, replace(options, weights=weights)),
               "gqa": GPTEngine(stored, replace(options, weights=f"{weights}+{GQA}"))}
    print(f"gpt/{stored.version}: {weights} weights, its step graph as stored and as the {weights}+{GQA} variant")
    text = (args.data_dir / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")
    rng = np.random.default_rng(0)

    def prompts(count: int) -> list[list[int]]:
        out = []
        for _ in range(count):
            chars = int(rng.integers(*VARIED_CHARS)) if args.varied else PROMPT_CHARS
            start = int(rng.integers(0, len(text) - chars))
            out.append(engines["mha"].tokenizer.encode(text[start : start + chars]).ids)
        return out

    def generate(name: str, rows: list[list[int]]):
        engine = engines[name]
        return [s.results()[0] for s in engine.generate(rows, lambda _: GreedySearch(
            NEW_TOKENS, engine.eos_id, min_new_tokens=NEW_TOKENS))]

    for batch in args.batches:
        rows = prompts(batch)
        same = sum(a.tokens == b.tokens for a, b in zip(generate("mha", rows), generate("gqa", rows)))
        seconds: dict[str, list[float]] = {"mha": [], "gqa": []}
        for _ in range(GENERATE_SAMPLES):
            for name in seconds:
                started = time.perf_counter()
                generate(name, rows)
                seconds[name].append(time.perf_counter() - started)
        mha, gqa = (batch * NEW_TOKENS / statistics.median(seconds[name]) for name in ("mha", "gqa"))
        print(f"batch {batch}: MultiHeadAttention {mha:,.0f} tokens/s, GroupQueryAttention {gqa:,.0f} tokens/s, "
              f"gqa/mha = {gqa / mha:.2f}; identical greedy sequences {same}/{batch}")
    rows = prompts(INVARIANCE_ROWS)
    together = generate("gqa", rows)
    alone = [generate("gqa", [row])[0] for row in rows]
    invariant = sum(a.tokens == b.tokens and a.score == b.score for a, b in zip(together, alone))
    print(f"GroupQueryAttention step graph, each row alone as in its batch of {INVARIANCE_ROWS}: "
          f"{invariant}/{INVARIANCE_ROWS} (tokens and scores)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--used", type=int, default=228, help="slots each row uses, the new token's included")
    parser.add_argument("--capacity", type=int, default=288, help="the buffer's slots (kv_storage.capacity_for)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--step-graph", action="store_true", help="compare in a served GPT's step graph")
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--version", type=int, default=None, help="the GPT version (default: the newest)")
    parser.add_argument("--batches", type=lambda v: [int(b) for b in v.split(",")], default=[1, 16, 64])
    parser.add_argument("--varied", action="store_true", help="prompts of 8 to 100 characters")
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    args = parser.parse_args(argv)
    if not 1 <= args.used <= args.capacity:
        parser.error("--used must be in [1, --capacity]")
    print(describe_cpu())
    if args.step_graph:
        return compare_step_graphs(args)
    batch, used, width = args.batch, args.used, HEADS * HEAD_DIM
    mha, gqa = sessions(batch, args.capacity, args.threads)
    rng = np.random.default_rng(0)
    q, k_new, v_new = (rng.normal(size=(batch, 1, width)).astype(np.float32) for _ in range(3))
    keys = np.zeros((batch, HEADS, args.capacity, HEAD_DIM), np.float32)
    values = np.zeros_like(keys)
    keys[:, :, : used - 1] = rng.normal(size=(batch, HEADS, used - 1, HEAD_DIM))
    values[:, :, : used - 1] = rng.normal(size=(batch, HEADS, used - 1, HEAD_DIM))
    past_k, past_v = keys.copy(), values.copy()  # GroupQueryAttention writes the new slot itself
    keys[:, :, used - 1] = k_new.reshape(batch, HEADS, HEAD_DIM)  # MultiHeadAttention reads it written (ScatterND)
    values[:, :, used - 1] = v_new.reshape(batch, HEADS, HEAD_DIM)
    mask = (np.arange(args.capacity) < used).astype(np.int32)[None].repeat(batch, axis=0)
    feeds = {"q": q, "k": keys, "v": values, "mask": mask}
    binding = gqa.io_binding()
    seqlens, total = np.full(batch, used - 1, np.int32), np.array([used], np.int32)
    out = np.empty((batch, 1, width), np.float32)
    for name, array in (("q", q), ("k_new", k_new), ("v_new", v_new), ("past_k", past_k), ("past_v", past_v),
                        ("seqlens_k", seqlens), ("total", total)):
        _bind(binding, name, array)
    for name, array in (("out", out), ("present_k", past_k), ("present_v", past_v)):
        _bind(binding, name, array, output=True)  # the present is the past's buffer: written in place
    expected = mha.run(None, feeds)[0]
    gqa.run_with_iobinding(binding)
    written = np.array_equal(past_k[:, :, used - 1], keys[:, :, used - 1])
    timings: dict[str, list[float]] = {"mha": [], "gqa": []}
    for _ in range(SAMPLES):  # interleaved
        for name, call in (("mha", lambda: mha.run(None, feeds)), ("gqa", lambda: gqa.run_with_iobinding(binding))):
            started = time.perf_counter()
            for _ in range(CALLS_PER_SAMPLE):
                call()
            timings[name].append((time.perf_counter() - started) / CALLS_PER_SAMPLE)
    m, g = statistics.median(timings["mha"]), statistics.median(timings["gqa"])
    print(f"batch {batch}, {used} of {args.capacity} slots used, {args.threads} threads: MultiHeadAttention "
          f"{m * 1e6:.0f} us, GroupQueryAttention {g * 1e6:.0f} us, mha/gqa = {m / g:.2f}; outputs differ by at most "
          f"{float(np.abs(expected - out).max()):.1e}; new slot written in place: {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
