"""Attention fusion on the tiny exported models: every attention block becomes one com.microsoft
MultiHeadAttention node, the graphs keep their interface, and ONNX Runtime computes what the written-out graphs
compute: logits, presents and cross-attention keys/values on padded batches with and without a past, and identical
greedy and beam outputs through the engines."""

import shutil

import numpy as np
import onnx
import pytest

from export.attention_fusion import FUSED_OP, fuse_attention
from export.checks import left_padded
from service.decoding import BeamSearch, GreedySearch
from service.engines import onnx_schema as schema
from service.engines.gpt import GPTEngine
from service.engines.runtime import create_session
from service.engines.translation import TranslationEngine
from service.repository import ModelRepository

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5
KINDS = ("gpt", "translation", "vit")
GERMAN = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau in einem roten Kleid singt.",
          "Ein kleines Mädchen klettert in ein Spielhaus aus Holz.", "Kinder laufen am Strand."]
PROMPTS = ["ROMEO:\n", "First Citizen:\nBefore we proceed", "To be", "KING RICHARD III:\nNow is the winter"]


@pytest.fixture(scope="module")
def repositories(tiny_repository, tiny_repository_copy) -> tuple[ModelRepository, ModelRepository, dict[str, int]]:
    """(the tiny repository, a copy with every graph fused, fused blocks per "kind/file")."""
    root = tiny_repository_copy("fused", KINDS)
    counts = {}
    for kind in KINDS:
        for path in sorted((root / kind / "1").glob("*.onnx")):
            counts[f"{kind}/{path.name}"] = fuse_attention(path)
    return ModelRepository(tiny_repository), ModelRepository(root), counts


def _sessions(repositories, kind: str, file: str):
    plain, fused, _ = repositories
    return (create_session(plain.get(kind).path / file), create_session(fused.get(kind).path / file))


def _compare(plain, fused, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run both sessions: every output agrees within TOLERANCE, padded rows included, and the fused outputs are
    finite. Returns the plain outputs."""
    expected, actual = plain.run(None, feeds), fused.run(None, feeds)
    for meta, a, b in zip(plain.get_outputs(), expected, actual):
        assert a.shape == b.shape and np.isfinite(b).all(), meta.name
        assert np.abs(a - b).max() <= TOLERANCE, (meta.name, float(np.abs(a - b).max()))
    return expected


def test_every_attention_block_is_fused(repositories):
    plain, fused, counts = repositories
    gpt, translation, vit = (plain.get(kind).config["architecture"] for kind in KINDS)
    assert counts == {"gpt/decoder.onnx": gpt["n_layers"],
                      "translation/encoder.onnx": translation["n_encoder_layers"],
                      "translation/decoder.onnx": 2 * translation["n_decoder_layers"],  # self + cross per layer
                      "vit/model.onnx": vit["n_layers"]}
    for name, count in counts.items():
        kind, file = name.split("/")
        graph = onnx.load(str(fused.get(kind).path / file)).graph
        ops = [node.op_type for node in graph.node]
        assert ops.count(FUSED_OP) == count and "Softmax" not in ops, name


@pytest.mark.parametrize("name", ["gpt/decoder.onnx", "translation/encoder.onnx", "translation/decoder.onnx",
                                  "vit/model.onnx"])
def test_the_graph_interface_is_unchanged(repositories, name):
    plain, fused, _ = repositories
    kind, file = name.split("/")

    def interface(graph):
        return [[(v.name, v.type.tensor_type.elem_type, len(v.type.tensor_type.shape.dim)) for v in values]
                for values in (graph.input, graph.output)]

    assert interface(onnx.load(str(fused.get(kind).path / file)).graph) == \
        interface(onnx.load(str(plain.get(kind).path / file)).graph)


def test_a_fused_graph_is_left_alone(repositories, tmp_path):
    _, fused, _ = repositories
    path = tmp_path / "model.onnx"
    shutil.copy(fused.get("vit").path / schema.VIT_FILE, path)
    assert fuse_attention(path) == 0


def test_gpt_logits_and_presents_match(repositories):
    plain, fused = _sessions(repositories, "gpt", schema.GPT_DECODER_FILE)
    engine = GPTEngine(repositories[0].get("gpt"))
    prompts = [engine.tokenizer.encode(p).ids for p in PROMPTS]
    ids, mask, positions = left_padded(prompts)
    B = len(prompts)
    empty = {name: np.zeros((B, engine.n_heads, 0, engine.head_dim), np.float32)
             for i in range(engine.n_layers) for name in schema.past_names(i)}
    # Left-padded prompts with an empty past: padded query rows attend to no key at all.
    prefill = {schema.INPUT_IDS: ids, schema.POSITION_IDS: positions, schema.ATTENTION_MASK: mask, **empty}
    _, *presents = _compare(plain, fused, prefill)
    # Two more tokens per row after that past (the padded slots stay masked).
    step_ids = np.tile(np.array([[65, 66]], np.int64), (B, 1))
    step_positions = mask.sum(1, keepdims=True) + np.arange(2)
    step = {schema.INPUT_IDS: step_ids, schema.POSITION_IDS: step_positions,
            schema.ATTENTION_MASK: np.concatenate([mask, np.ones((B, 2), np.int64)], axis=1),
            **dict(zip(empty, presents))}
    _compare(plain, fused, step)


def test_translation_encoder_and_decoder_match(repositories):
    plain_encoder, fused_encoder = _sessions(repositories, "translation", schema.ENCODER_FILE)
    plain, fused = _sessions(repositories, "translation", schema.DECODER_FILE)
    engine = TranslationEngine(repositories[0].get("translation"))
    sources = [engine.source_ids(text) for text in GERMAN]
    S = max(len(s) for s in sources)
    src_ids, src_mask = np.zeros((len(sources), S), np.int64), np.zeros((len(sources), S), np.int64)
    for row, source in enumerate(sources):
        src_ids[row, : len(source)], src_mask[row, : len(source)] = source, 1
    cross = _compare(plain_encoder, fused_encoder, {schema.INPUT_IDS: src_ids, schema.ATTENTION_MASK: src_mask})
    # Beams of sources 0, 1 and 4 (two each for 1 and 4), right-padded teacher-forced prefixes, empty past.
    encoder_row = np.array([0, 1, 1, 4, 4], np.int64)
    R, T, H, Dh = len(encoder_row), 4, engine.n_heads, engine.head_dim
    lengths = np.array([4, 2, 3, 1, 4])
    mask = (np.arange(T) < lengths[:, None]).astype(np.int64)
    ids = np.where(mask == 1, np.arange(10, 10 + T), engine.pad_id).astype(np.int64)
    feeds = {schema.INPUT_IDS: ids, schema.POSITION_IDS: np.tile(np.arange(T), (R, 1)),
             schema.ATTENTION_MASK: mask, schema.ENCODER_ATTENTION_MASK: src_mask, schema.ENCODER_ROW: encoder_row}
    for i in range(engine.n_layers):
        feeds.update({name: np.zeros((R, H, 0, Dh), np.float32) for name in schema.past_names(i)})
        feeds.update(zip(schema.cross_names(i), cross[2 * i : 2 * i + 2]))
    _, *presents = _compare(plain, fused, feeds)
    # One more token per row after that past.
    feeds.update({schema.INPUT_IDS: np.full((R, 1), 20, np.int64), schema.POSITION_IDS: lengths[:, None],
                  schema.ATTENTION_MASK: np.concatenate([mask, np.ones((R, 1), np.int64)], axis=1)})
    feeds.update(zip([n for i in range(engine.n_layers) for n in schema.past_names(i)], presents))
    _compare(plain, fused, feeds)


def test_vit_logits_match(repositories):
    plain, fused = _sessions(repositories, "vit", schema.VIT_FILE)
    image = repositories[0].get("vit").config["image"]
    pixels = np.random.default_rng(0).standard_normal((6, image["channels"], image["size"], image["size"]))
    _compare(plain, fused, {schema.PIXEL_VALUES: pixels.astype(np.float32)})


def _tokens(searches) -> list[list[list[int]]]:
    return [[h.tokens for h in search.results()] for search in searches]


def test_gpt_greedy_and_beam_outputs_are_identical(repositories):
    plain, fused = (GPTEngine(repository.get("gpt")) for repository in repositories[:2])
    prompts = [plain.tokenizer.encode(p).ids for p in PROMPTS]
    for make in (lambda i: GreedySearch(max_new_tokens=20, eos_token_id=plain.eos_id),
                 lambda i: BeamSearch(num_beams=3, max_new_tokens=12, eos_token_id=plain.eos_id,
                                      num_return_sequences=3)):
        assert _tokens(fused.generate(prompts, make)) == _tokens(plain.generate(prompts, make))


def test_translation_greedy_and_beam_outputs_are_identical(repositories):
    plain, fused = (TranslationEngine(repository.get("translation")) for repository in repositories[:2])
    sources = [plain.source_ids(text) for text in GERMAN]
    for make in (lambda i: GreedySearch(max_new_tokens=plain.default_max_new_tokens(len(sources[i])),
                                        eos_token_id=plain.eos_id),
                 lambda i: BeamSearch(num_beams=4, max_new_tokens=plain.default_max_new_tokens(len(sources[i])),
                                      eos_token_id=plain.eos_id, num_return_sequences=2)):
        assert _tokens(fused.translate_ids(sources, make)) == _tokens(plain.translate_ids(sources, make))
