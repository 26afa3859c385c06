"""The `+gqa` variants (`service.engines.step_attention`): the in-place step graph's ScatterND x 2 +
MultiHeadAttention per layer rewritten into one GroupQueryAttention when the graph loads, against the graph as
stored (ONNX Runtime's own masked kernel is the oracle), and their quality check at export (`export.variants`)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from service.engines.gpt import GPTEngine
from service.engines.onnx_graph import load
from service.engines.runtime import RuntimeOptions
from service.engines.step_attention import has_masked_step_attention, to_group_query_attention
from service.engines import weights
from service.engines.weights import VARIANTS, derive, split_variant
from service.repository import ModelRepository
from tests.support.repository import add_in_place_gpt

pytestmark = pytest.mark.slow

PROMPTS = ["ROMEO:\nWhat", "A", "First Citizen:\nBefore we proceed", "KING HENRY", "O"]
STEPS = 24
# |GroupQueryAttention logit - MultiHeadAttention logit|, tiny GPT, float32 weights, teacher-forced: another
# summation order of the same float32 products (measured up to ~2e-6; logits' std ~2.5)
LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module")
def step_repository(tiny_repository_copy, data_dir):
    """The tiny GPT (version 1: no step graph) and its fused-attention in-place conversion (version 2)."""
    return add_in_place_gpt(tiny_repository_copy("step-attention", ("gpt",)), data_dir)


def _teacher_forced_logits(engine: GPTEngine, prompts: list[list[int]], tokens: np.ndarray) -> np.ndarray:
    """(steps + 1, rows, V): the prompt pass's last logits, then each step's, feeding `tokens` (steps, rows)."""
    logits, cache = engine.prefill(prompts)
    out = [logits]
    for step_tokens in tokens:
        out.append(engine.step(cache, step_tokens))
    return np.stack(out)


def test_each_layer_becomes_one_group_query_attention_with_the_same_interface(step_repository):
    version = ModelRepository(step_repository).get("gpt", 2)
    model = load(version.path / version.config["files"]["decoder_step"])
    interface = ([i.name for i in model.graph.input], [o.name for o in model.graph.output])
    assert has_masked_step_attention(model)
    layers = to_group_query_attention(model)
    ops = [node.op_type for node in model.graph.node]
    assert layers == version.config["architecture"]["n_layers"] == ops.count("GroupQueryAttention")
    assert "MultiHeadAttention" not in ops and "ScatterND" not in ops
    assert ([i.name for i in model.graph.input], [o.name for o in model.graph.output]) == interface
    onnx.checker.check_model(onnx.load_from_string(model.SerializeToString()))  # valid, nodes in order
    assert not has_masked_step_attention(model)
    with pytest.raises(ValueError, match="not an in-place step graph"):
        to_group_query_attention(model)  # nothing left to rewrite
    prompt_pass = load(version.path / version.config["files"]["decoder"])
    assert not has_masked_step_attention(prompt_pass)


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_the_steps_compute_what_the_masked_kernel_computes(step_repository, weights):
    version = ModelRepository(step_repository).get("gpt", 2)
    masked, grouped = (GPTEngine(version, RuntimeOptions(weights=variant)) for variant in (weights, f"{weights}+gqa"))
    prompts = [masked.tokenizer.encode(text).ids for text in PROMPTS]
    tokens = np.random.default_rng(0).integers(0, masked.vocab_size, (STEPS, len(prompts)))
    expected = _teacher_forced_logits(masked, prompts, tokens)
    actual = _teacher_forced_logits(grouped, prompts, tokens)
    np.testing.assert_array_equal(actual[0], expected[0])  # the prompt pass is not rewritten
    np.testing.assert_allclose(actual, expected, rtol=0, atol=LOGITS_ATOL)
    derived = onnx.load_from_string(derive(version.path / version.config["files"]["decoder_step"], f"{weights}+gqa"))
    assert any(node.op_type == "GroupQueryAttention" for node in derived.graph.node)  # another kernel ran: the
    # logits alone cannot show it on every CPU (its sums may happen to round as the masked kernel's)


def test_variant_names_and_graphs_without_step_attention(step_repository):
    assert VARIANTS == ("fp32", "int8", "int8rows", "fp32+gqa", "int8+gqa", "int8rows+gqa", "fp32+gqa+kv8",
                        "int8+gqa+kv8", "int8rows+gqa+kv8")
    assert split_variant("int8+gqa") == ("int8", "gqa") and split_variant("fp32") == ("fp32", None)
    assert split_variant("int8+gqa+kv8") == ("int8", "gqa+kv8")
    with pytest.raises(ValueError, match="variant must be one of"):
        split_variant("int4+gqa")
    version = ModelRepository(step_repository).get("gpt", 2)
    stored = version.config["weights"]
    assert derive(version.path / version.config["files"]["decoder"], f"{stored}+gqa") is None  # the prompt pass
    assert derive(version.path / version.config["files"]["decoder_step"], f"{stored}+gqa") is not None


def test_export_checks_the_gqa_variants_through_the_steps_only_where_there_is_a_step_graph(step_repository, data_dir):
    from export.variants import candidate_variants, check_variants

    repository = ModelRepository(step_repository)
    # no step graph: no attention to rewrite
    assert candidate_variants(repository.get("gpt", 1)) == ["int8", "int8rows"]
    version = repository.get("gpt", 2)
    assert candidate_variants(version) == ["int8", "int8rows", "fp32+gqa", "int8+gqa", "int8rows+gqa",
                                           "fp32+gqa+kv8", "int8+gqa+kv8", "int8rows+gqa+kv8"]
    results = check_variants(version, str(data_dir))
    assert set(results) == set(candidate_variants(version))
    card = json.loads((version.path / "metrics.json").read_text())
    for variant in ("fp32+gqa", "int8+gqa", "fp32+gqa+kv8", "int8+gqa+kv8"):
        result = results[variant]
        assert result["passed"], result
        assert result["data"].endswith("scored through the decoding steps")
        assert result["reference"] == card["val_loss"]
        assert abs(result["measured"] - card["val_loss"]) <= result["tolerance"]
    offered = ModelRepository(step_repository).get("gpt", 2).config
    assert {"fp32+gqa", "int8+gqa", "fp32+gqa+kv8", "int8+gqa+kv8"} <= set(offered["variants"])
    assert offered["kv_cache_scales"]["file"] == "kv_cache_scales.npy"  # measured first, for the kv8 variants
    assert (version.path / "kv_cache_scales.npy").is_file()


@pytest.mark.parametrize("version", [1, 2])
def test_the_step_validation_loss_equals_the_prompt_pass_loss(step_repository, data_dir, version):
    """The check a `+gqa` variant is held to scores the same windows through the steps (version 1 steps by
    concatenation, version 2 in place): as stored, it must give the prompt pass's figure."""
    from export import checks
    from models.data import load_shakespeare

    engine = GPTEngine(ModelRepository(step_repository).get("gpt", version))
    _, text = load_shakespeare(data_dir)
    ids = np.asarray(engine.tokenizer.encode(text[:20_000]).ids, np.int64)
    steps, prompt_pass = checks.gpt_step_validation_loss(engine, ids), checks.gpt_validation_loss(engine, ids)
    assert steps == pytest.approx(prompt_pass, abs=1e-5)
    assert checks.gpt_step_validation_loss(engine, ids[::-1].copy()) != pytest.approx(steps, abs=1e-3)  # not a constant


def test_a_gqa_cache_grows_to_the_context_length_at_once_with_the_same_logits(step_repository):
    """GroupQueryAttention reads each row's used slots only, so a `+gqa` engine grows a full cache straight to the
    context length (`KVCache.limit`): one copy instead of several, and the same logits, bit for bit, as growing by
    the headroom (the masked kernel reads the whole buffer: its engine keeps the headroom)."""
    version = ModelRepository(step_repository).get("gpt", 2)
    grouped, by_headroom = (GPTEngine(version, RuntimeOptions(weights="fp32+gqa")) for _ in range(2))
    assert grouped.cache_limit == grouped.context_length
    assert GPTEngine(version, RuntimeOptions(weights="fp32")).cache_limit is None
    by_headroom.cache_limit = None
    prompts = [grouped.tokenizer.encode(text).ids for text in PROMPTS]
    tokens = np.random.default_rng(1).integers(0, grouped.vocab_size, (STEPS, len(prompts)))
    capacities = {}
    for name, engine in (("grouped", grouped), ("by_headroom", by_headroom)):
        logits, cache = engine.prefill(prompts)
        out, seen = [logits], {cache.capacity}
        for step_tokens in tokens:
            out.append(engine.step(cache, step_tokens))
            seen.add(cache.capacity)
        capacities[name] = sorted(seen)
        capacities[name + " logits"] = np.stack(out)
    assert capacities["grouped"][-1] == grouped.context_length and len(capacities["by_headroom"]) > 2
    np.testing.assert_array_equal(capacities["grouped logits"], capacities["by_headroom logits"])


def test_fused_projections_feed_group_query_attention_packed_with_the_same_logits(step_repository, monkeypatch):
    """With the projections fused (one MatMul for Q, K and V, then a Split), a `+gqa` step graph hands
    GroupQueryAttention the fused output as its packed QKV query and drops the Split (`pack_query_key_value`):
    the same logits, bit for bit, as the unpacked graph."""
    version = ModelRepository(step_repository).get("gpt", 2)
    step_file = version.path / version.config["files"]["decoder_step"]
    options = RuntimeOptions(weights="fp32+gqa", fuse_projections=True)
    weights._derived.cache_clear()
    packed = GPTEngine(version, options)
    graph = onnx.load_from_string(derive(step_file, "fp32+gqa", fuse=True))
    attention = [node for node in graph.graph.node if node.op_type == "GroupQueryAttention"]
    assert attention and all(list(node.input[1:3]) == ["", ""] for node in attention)
    assert not any(node.op_type == "Split" for node in graph.graph.node)
    weights._derived.cache_clear()
    monkeypatch.setattr(weights, "pack_query_key_value", lambda model: 0)
    unpacked = GPTEngine(version, options)
    assert any(node.op_type == "Split" for node in onnx.load_from_string(
        derive(step_file, "fp32+gqa", fuse=True)).graph.node)  # the same graph, fused but not packed
    weights._derived.cache_clear()
    prompts = [packed.tokenizer.encode(text).ids for text in PROMPTS]
    tokens = np.random.default_rng(2).integers(0, packed.vocab_size, (STEPS, len(prompts)))
    np.testing.assert_array_equal(_teacher_forced_logits(packed, prompts, tokens),
                                  _teacher_forced_logits(unpacked, prompts, tokens))
