"""The `+gqa+kv8` variants (`service.engines.kv_quantization`): GroupQueryAttention over an int8 KV cache. ONNX
Runtime's own kernel is the oracle of the quantisation rule (what the prompt pass writes must be what a step
writes), the float32-cache variant the oracle of the logits (within what int8 keys and values can move them)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from export.kv_scales import write_scales
from service.engines.gpt import GPTEngine
from service.engines.kv_quantization import LEVELS, SCALES_FILE, load_scales, quantize, scales_from_peaks
from service.engines.runtime import RuntimeOptions
from service.engines.weights import derive, quantizes_kv_cache
from service.repository import ModelRepository
from tests.support.repository import add_in_place_gpt

PROMPTS = ["ROMEO:\nWhat", "A", "First Citizen:\nBefore we proceed", "KING HENRY", "O"]
STEPS = 24
# |logit with an int8 cache - logit with the float32 one|, tiny GPT, teacher-forced: each key and value moves by at
# most half its channel's step (max |x| / 254); measured up to ~0.03 on logits of std ~2.5. A wrong scale (another
# layer's, keys for values, a transposed head) moves them by whole units.
LOGITS_ATOL = 0.25
LOGITS_MEAN_ATOL = 0.02


def _kernel_written(keys: np.ndarray, values: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What ONNX Runtime's GroupQueryAttention writes into an empty int8 cache for one new token's keys and values
    (heads, head_dim) with per-channel scales (2, heads, head_dim)."""
    heads, dim = keys.shape
    width = heads * dim
    inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [1, 1, 3 * width]),
              helper.make_tensor_value_info("past_key", TensorProto.INT8, [1, heads, 4, dim]),
              helper.make_tensor_value_info("past_value", TensorProto.INT8, [1, heads, 4, dim]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [1])]
    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total",
                                                    "", "", "", "", "", "k_scale", "v_scale"],
                            ["out", "present_key", "present_value"], domain="com.microsoft", num_heads=heads,
                            kv_num_heads=heads, k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL",
                            kv_cache_bit_width=8)
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, None),
               helper.make_tensor_value_info("present_key", TensorProto.INT8, None),
               helper.make_tensor_value_info("present_value", TensorProto.INT8, None)]
    graph = helper.make_graph([node], "kv8", inputs, outputs,
                              [onnx.numpy_helper.from_array(scales[0], "k_scale"),
                               onnx.numpy_helper.from_array(scales[1], "v_scale")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    qkv = np.concatenate([np.zeros(width, np.float32), keys.ravel(), values.ravel()]).reshape(1, 1, -1)
    empty = np.zeros((1, heads, 4, dim), np.int8)
    _, present_key, present_value = session.run(None, {"qkv": qkv, "past_key": empty, "past_value": empty,
                                                       "seqlens_k": np.zeros(1, np.int32),
                                                       "total": np.ones(1, np.int32)})
    return present_key[0, :, 0], present_value[0, :, 0]


def test_the_prompt_pass_quantises_as_the_kernel_writes_a_step():
    rng = np.random.default_rng(0)
    heads, dim = 2, 16
    scales = rng.uniform(0.01, 0.1, (2, heads, dim)).astype(np.float32)
    # exact halves (ties), values past the range (clamped both ways) and ordinary ones
    levels = rng.integers(-140, 140, (2, heads, dim)) + rng.choice([0.5, 0.0, 0.25], (2, heads, dim))
    levels[:, 0, :4] = [-1000, 1000, -128.5, 127.5]
    keys, values = (levels * scales).astype(np.float32)
    expected = _kernel_written(keys, values, scales)
    # the prompt pass's presents: (rows, heads, slots, head_dim), layer 0 keys then values
    quantized = quantize([keys[None, :, None], values[None, :, None]], scales[None])
    for written, ours in zip(expected, quantized):
        assert ours.dtype == np.int8
        np.testing.assert_array_equal(ours[0, :, 0], written)
    assert quantized[0][0, 0, 0, :2].tolist() == [-128, 127]  # clamped
    assert scales_from_peaks(np.array([0.0, 2.54])).tolist() == [1.0, pytest.approx(2.54 / LEVELS)]


@pytest.fixture(scope="module")
def kv8_version(tiny_repository_copy, data_dir):
    """The tiny GPT with an in-place step graph (converted from version 1) and its KV scales."""
    repository = add_in_place_gpt(tiny_repository_copy("kv8", ("gpt",)), data_dir)
    version = ModelRepository(repository).get("gpt", 2)
    with pytest.raises(ValueError, match=SCALES_FILE):  # no scales yet: no int8 cache
        derive(version.path / version.config["files"]["decoder_step"], "fp32+gqa+kv8")
    described = write_scales(version, str(data_dir))
    assert described["file"] == SCALES_FILE and "training text" in described["data"]
    return ModelRepository(repository).get("gpt", 2)


def _teacher_forced(engine: GPTEngine, prompts: list[list[int]], tokens: np.ndarray):
    logits, cache = engine.prefill(prompts)
    out = [logits]
    for step_tokens in tokens:
        out.append(engine.step(cache, step_tokens))
    return np.stack(out), cache


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_an_int8_cache_moves_the_logits_by_what_int8_keys_and_values_can(kv8_version, weights):
    reference, quantized = (GPTEngine(kv8_version, RuntimeOptions(weights=v))
                            for v in (f"{weights}+gqa", f"{weights}+gqa+kv8"))
    assert quantizes_kv_cache(f"{weights}+gqa+kv8") and not quantizes_kv_cache(f"{weights}+gqa")
    prompts = [reference.tokenizer.encode(text).ids for text in PROMPTS]
    tokens = np.random.default_rng(0).integers(0, reference.vocab_size, (STEPS, len(prompts)))
    expected, _ = _teacher_forced(reference, prompts, tokens)
    actual, cache = _teacher_forced(quantized, prompts, tokens)
    assert all(array.dtype == np.int8 for array in (*cache.keys, *cache.values))  # the cache the steps ran on
    np.testing.assert_array_equal(actual[0], expected[0])  # the prompt pass itself is the float32 graph
    difference = np.abs(actual - expected)
    assert difference.max() <= LOGITS_ATOL and difference.mean() <= LOGITS_MEAN_ATOL, difference.max()
    # and the int8 slots are the float32 cache's keys and values, quantised: layer 0's depend on the tokens only
    _, float_cache = _teacher_forced(reference, prompts, tokens)
    scales = load_scales(kv8_version.path)
    for row in range(len(prompts)):
        used = int(cache.lengths[row])
        for kind, (ours, floats) in enumerate(((cache.keys[0], float_cache.keys[0]),
                                               (cache.values[0], float_cache.values[0]))):
            scale = scales[0, kind][:, None, :]
            restored = ours[row, :, :used].astype(np.float32) * scale
            # the same value up to half a step, or the range's end where it lies outside (random tokens: some are
            # bytes the calibration text never had)
            within = np.clip(floats[row, :, :used], -128 * scale, 127 * scale)
            assert np.abs(restored - within).max() <= scales[0, kind].max() * (0.5 + 1e-3)


@pytest.mark.slow
def test_a_row_alone_and_in_a_batch_decodes_the_same_with_an_int8_cache(kv8_version):
    engine = GPTEngine(kv8_version, RuntimeOptions(weights="fp32+gqa+kv8"))
    prompts = [engine.tokenizer.encode(text).ids for text in PROMPTS]
    tokens = np.random.default_rng(2).integers(0, engine.vocab_size, (STEPS, len(prompts)))
    together, _ = _teacher_forced(engine, prompts, tokens)
    alone, _ = _teacher_forced(engine, prompts[2:3], tokens[:, 2:3])
    np.testing.assert_array_equal(together[:, 2], alone[:, 0])


@pytest.mark.slow
def test_scales_are_one_per_layer_kind_head_and_channel_and_bad_ones_are_refused(kv8_version, tmp_path):
    scales = load_scales(kv8_version.path)
    architecture = kv8_version.config["architecture"]
    assert scales.shape == (architecture["n_layers"], 2, architecture["n_heads"], architecture["head_dim"])
    assert (scales > 0).all() and np.unique(scales).size > scales.size // 2  # measured, not one constant
    for bad in (scales[0], np.zeros_like(scales)):
        np.save(tmp_path / SCALES_FILE, bad)
        with pytest.raises(ValueError, match="expected finite positive scales"):
            load_scales(tmp_path)


@pytest.mark.parametrize("write, says", [
    (lambda path: np.save(path, np.full((2, 2, 4, 8), np.inf, np.float32)), "expected finite positive scales"),
    (lambda path: np.save(path, np.full((2, 2, 4, 8), np.nan, np.float32)), "expected finite positive scales"),
    (lambda path: np.save(path, np.array([{"a": 1}], dtype=object)), "is not a NumPy file of scales"),
    (lambda path: np.save(path, np.array(["x"])), "is not a NumPy file of scales"),
    (lambda path: path.write_bytes(b"not an array"), "is not a NumPy file of scales"),
    (lambda path: (np.save(path, np.ones((2, 2, 4, 8), np.float32)),
                   path.write_bytes(path.read_bytes()[:-16])), "is not a NumPy file of scales"),
], ids=["inf", "nan", "pickled objects", "text", "not npy", "cut short"])
def test_a_damaged_scales_file_is_refused_naming_it(tmp_path, write, says):
    write(tmp_path / SCALES_FILE)
    with pytest.raises(ValueError, match=says) as caught:
        load_scales(tmp_path)
    assert str(tmp_path / SCALES_FILE) in str(caught.value)


@pytest.mark.slow
def test_a_rewritten_scales_file_is_what_the_next_derivation_reads(kv8_version):
    """The derived step graph is cached by its file and by the scales file beside it: scales measured again (a
    model-control reload after `export.kv_scales`) reach the step graph, as they reach the engine's prompt pass."""
    step = kv8_version.path / kv8_version.config["files"]["decoder_step"]
    path = kv8_version.path / SCALES_FILE
    scales = load_scales(kv8_version.path)
    before = derive(step, "fp32+gqa+kv8")
    try:
        np.save(path, scales * 2)
        after = derive(step, "fp32+gqa+kv8")
        assert after != before
        assert onnx.numpy_helper.to_array(next(t for t in onnx.load_from_string(after).graph.initializer
                                                if t.name == "kv8/0/key_scale")).tolist() == (scales[0, 0] * 2).tolist()
    finally:
        np.save(path, scales)
    assert derive(step, "fp32+gqa+kv8") == before
