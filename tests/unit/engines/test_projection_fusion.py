"""Sibling projections fused at load (`service.engines.projection_fusion`): the MatMuls (float or MatMulNBits) that
read one input become one MatMul and a Split, the others stay; ONNX Runtime's outputs are the same bit for bit, on
small graphs and on the released models decoding real batches (the service fuses by default,
`RuntimeOptions.fuse_projections`)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from service.decoding import BeamSearch, GreedySearch
from service.engines import weights as W
from service.engines.gpt import GPTEngine
from service.engines.onnx_graph import ModelProto
from service.engines.projection_fusion import fuse_projections, fused_projection_count
from service.engines.runtime import RuntimeOptions
from service.engines.translation import TranslationEngine
from service.engines.vit import ViTEngine
from service.repository import ModelRepository
from tests.support import ROOT

D, ROWS = 64, 7
RELEASE_REPOSITORY = ROOT / "model_repository"


def _attention_like_graph(path, seed=0, biased=""):
    """x (rows, 1, D) -> q, k, v = x @ Wq, x @ Wk, x @ Wv (three siblings; those named in `biased` followed by the
    Add of a bias) and y = (q * k + v) @ Wo (alone)."""
    rng = np.random.default_rng(seed)
    weights = {name: rng.standard_normal((D, D)).astype(np.float32) for name in ("wq", "wk", "wv", "wo")}
    weights |= {f"b{p}": rng.standard_normal(D).astype(np.float32) for p in biased}
    nodes = []
    for p in "qkv":
        if p in biased:
            nodes += [helper.make_node("MatMul", ["x", f"w{p}"], [f"{p}_mm"], name=f"{p}_proj"),
                      helper.make_node("Add", [f"b{p}", f"{p}_mm"], [p], name=f"{p}_bias")]
        else:
            nodes.append(helper.make_node("MatMul", ["x", f"w{p}"], [p], name=f"{p}_proj"))
    nodes += [helper.make_node("Mul", ["q", "k"], ["qk"]), helper.make_node("Add", ["qk", "v"], ["h"]),
              helper.make_node("MatMul", ["h", "wo"], ["y"], name="out_proj")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 1, D])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["rows", 1, D])
                               for name in ("y", "v")],
                              [numpy_helper.from_array(w, name) for name, w in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _run(graph: bytes, x: np.ndarray) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 2
    return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"]).run(None, {"x": x})


def _fused(graph: bytes) -> tuple[bytes, int]:
    model = ModelProto()
    model.ParseFromString(graph)
    groups = fuse_projections(model)
    return model.SerializeToString(), groups


@pytest.mark.parametrize("biased", ["", "qkv"])
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_siblings_become_one_matmul_and_a_split_with_the_same_outputs(tmp_path, weights, biased):
    path = _attention_like_graph(tmp_path / "g.onnx", biased=biased)
    plain = W.derive(path, weights) or path.read_bytes()
    fused, groups = _fused(plain)
    assert groups == 1  # q, k and v; the output projection reads another input and stays
    model = onnx.load_from_string(fused)
    ops = [n.op_type for n in model.graph.node]
    matmul = "MatMul" if weights == "fp32" else "MatMulNBits"
    assert ops.count(matmul) == 2 and ops.count("Split") == 1
    # the biases: one Add before the Split (float) or the fused MatMulNBits' bias input (int8), plus the graph's own
    assert ops.count("Add") == 1 + (weights == "fp32" and biased == "qkv")
    assert fused_projection_count(ModelProto.FromString(fused)) == 1
    x = np.random.default_rng(1).standard_normal((ROWS, 1, D)).astype(np.float32)
    for expected, got in zip(_run(plain, x), _run(fused, x)):
        assert np.array_equal(expected, got)


def test_a_graph_without_siblings_or_before_opset_13_is_left_alone(tmp_path):
    path = _attention_like_graph(tmp_path / "g.onnx")
    model = onnx.load(str(path))
    for node in model.graph.node:  # a chain instead: k from q, v from k; every projection reads its own input
        if node.name in ("k_proj", "v_proj"):
            node.input[0] = "q" if node.name == "k_proj" else "k"
    assert fuse_projections(ModelProto.FromString(model.SerializeToString())) == 0
    old = onnx.load(str(path))
    old.opset_import[0].version = 12
    assert fuse_projections(ModelProto.FromString(old.SerializeToString())) == 0


def test_int8_siblings_with_different_accuracy_levels_stay_apart(tmp_path):
    plain = W.derive(_attention_like_graph(tmp_path / "g.onnx"), "int8")
    model = onnx.load_from_string(plain)
    node = next(n for n in model.graph.node if n.name.startswith("v_proj"))
    next(a for a in node.attribute if a.name == "accuracy_level").i = 0
    fused, groups = _fused(model.SerializeToString())
    assert groups == 1  # q and k only
    assert [n.op_type for n in onnx.load_from_string(fused).graph.node].count("MatMulNBits") == 3


def test_int8_siblings_of_which_only_some_add_a_bias_stay_apart(tmp_path):
    """ONNX Runtime folds a MatMulNBits' bias Add into the kernel; fusing q (biased) with k and v (not) would change
    q's rounding, so the group is left alone."""
    plain = W.derive(_attention_like_graph(tmp_path / "g.onnx", biased="q"), "int8")
    assert _fused(plain)[1] == 0
    float_graph = _attention_like_graph(tmp_path / "f.onnx", biased="q").read_bytes()
    fused, groups = _fused(float_graph)  # float MatMuls fuse; q's Add stays after the Split
    assert groups == 1
    x = np.random.default_rng(1).standard_normal((ROWS, 1, D)).astype(np.float32)
    for expected, got in zip(_run(float_graph, x), _run(fused, x)):
        assert np.array_equal(expected, got)


def test_derive_fuses_only_when_asked_and_the_service_fuses_by_default(tmp_path):
    path = _attention_like_graph(tmp_path / "g.onnx")
    assert W.derive(path, None) is None
    assert fused_projection_count(ModelProto.FromString(W.derive(path, None, fuse=True))) == 1
    assert RuntimeOptions().fuse_projections


@pytest.mark.slow
@pytest.mark.parametrize("kind, variant", [("gpt", None), ("gpt", "int8+gqa"), ("gpt", "fp32"),
                                           ("translation", None), ("translation", "int8"), ("vit", None)])
def test_the_released_models_answer_bit_identically_with_fused_projections(kind, variant):
    """A batch decoded (classified) by the released model with and without fused projections: the same tokens and
    scores (logits), bit for bit."""
    version = ModelRepository(RELEASE_REPOSITORY).get(kind)

    def answers(fuse: bool):
        options = RuntimeOptions(device="cpu", intra_op_threads=2, weights=variant, fuse_projections=fuse)
        if kind == "gpt":
            engine = GPTEngine(version, options)
            prompts = [engine.tokenizer.encode(p).ids for p in ("ROMEO:\n", "To be", "First Citizen:\nWe")] * 3
            searches = engine.generate(prompts, lambda _: GreedySearch(32, engine.eos_id, min_new_tokens=32))
            return [(r.tokens, r.score) for s in searches for r in s.results()]
        if kind == "translation":
            engine = TranslationEngine(version, options)
            sources = [engine.source_ids(s) for s in ("Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.",
                                                       "Kinder laufen am Strand.")] * 4
            searches = engine.translate_ids(sources, lambda _: BeamSearch(4, 30, engine.eos_id))
            return [(r.tokens, r.score) for s in searches for r in s.results()]
        engine = ViTEngine(version, options)
        pixels = np.random.default_rng(0).random((16, 1, 28, 28), dtype=np.float32)
        return engine.logits(engine.normalize(pixels)).tolist()

    assert answers(True) == answers(False)
