"""The in-place KV step graph (export.kv_inplace) and the engines running it: same tokens and logits as the
original graphs, buffers written in place, composition with attention fusion in either order."""

import json
import shutil
from collections import Counter

import numpy as np
import onnx
import pytest

from export.attention_fusion import fuse_attention
from export.kv_inplace import KVInplaceError, add_step_graph, make_inplace_kv
from service.decoding import BeamSearch, GreedySearch
from service.engines import onnx_schema as schema
from service.engines.gpt import GPTEngine
from service.engines.kv_storage import CAPACITY_STEP
from service.engines.translation import TranslationEngine
from service.repository import ModelRepository

pytestmark = pytest.mark.slow

GERMAN = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Kinder laufen am Strand."]
PROMPTS = ["ROMEO:\n", "First Citizen:\nBefore we proceed", "To be"]
LOGIT_TOLERANCE = 1e-5
STEPS = 24  # more than CAPACITY_STEP: the buffers grow at least once


def _repository(tiny_repository, root, fuse: str = ""):
    """Copies of the tiny gpt and translation versions with a step graph; `fuse`: "before" or "after" the
    in-place rewrite."""
    for kind in ("gpt", "translation"):
        version = root / kind / "1"
        shutil.copytree(tiny_repository / kind / "1", version)
        if fuse == "before":
            fuse_attention(version / schema.DECODER_FILE)
        config_path = version / "config.json"
        config = json.loads(config_path.read_text())
        add_step_graph(version, config)
        config_path.write_text(json.dumps(config))
        if fuse == "after":
            fuse_attention(version / schema.DECODER_STEP_FILE)
    return ModelRepository(root)


@pytest.fixture(scope="module")
def engines(tiny_repository, tmp_path_factory):
    """(original, in place) engine pairs per kind."""
    original = ModelRepository(tiny_repository)
    inplace = _repository(tiny_repository, tmp_path_factory.mktemp("inplace"))
    return {"gpt": (GPTEngine(original.get("gpt")), GPTEngine(inplace.get("gpt"))),
            "translation": (TranslationEngine(original.get("translation")),
                            TranslationEngine(inplace.get("translation")))}


def test_the_step_graph_scatters_into_the_past_and_takes_a_slot(engines):
    engine = engines["gpt"][1]
    model = onnx.load(str(engine.model.path / schema.DECODER_STEP_FILE))
    ops = Counter(node.op_type for node in model.graph.node)
    assert ops["ScatterND"] == 2 * engine.n_layers
    assert schema.CACHE_SLOT in {i.name for i in model.graph.input}
    assert engine.model.config["files"]["decoder_step"] == schema.DECODER_STEP_FILE


def test_a_graph_without_a_cache_is_refused(tiny_repository, tmp_path):
    path = tmp_path / "encoder.onnx"
    shutil.copyfile(tiny_repository / "translation" / "1" / schema.ENCODER_FILE, path)
    with pytest.raises(KVInplaceError):
        make_inplace_kv(path)


def _prompts(engine):
    return [engine.tokenizer.encode(p).ids for p in PROMPTS]


def test_gpt_steps_match_the_original_graph_and_write_in_place(engines):
    original, inplace = engines["gpt"]
    prompts = _prompts(original)
    (expected, old), (logits, new) = original.prefill(prompts), inplace.prefill(prompts)
    np.testing.assert_allclose(logits, expected, atol=LOGIT_TOLERANCE)
    tokens = expected.argmax(-1)
    for step in range(STEPS):
        keys = new.keys[0] if new.buffered and new.length < new.capacity else None
        expected, logits = original.step(old, tokens), inplace.step(new, tokens)
        np.testing.assert_allclose(logits, expected, atol=LOGIT_TOLERANCE)
        if keys is not None:
            assert new.keys[0] is keys  # written in place: same buffer, no reallocation
        tokens = expected.argmax(-1)
    assert new.length == max(map(len, prompts)) + STEPS and new.capacity >= new.length > CAPACITY_STEP
    for row in range(new.rows):  # the same keys in the same order, each row's from slot 0 in the buffers
        used = np.flatnonzero(old.mask[row])
        assert new.lengths[row] == len(used) and new.mask[row, : len(used)].all()
        assert not new.mask[row, len(used):].any()
        np.testing.assert_allclose(new.keys[-1][row, :, : len(used)], old.keys[-1][row][:, used],
                                   atol=LOGIT_TOLERANCE)


def test_one_binding_lasts_exactly_as_long_as_the_buffers(engines):
    """A step reuses the IO binding of the step before while the cache's arrays are the same objects, and binds
    again once growth or a gathering reorder replaced them (the new binding points into the new buffers: the
    logits stay the original graph's)."""
    original, inplace = engines["gpt"]
    prompts = _prompts(original)
    (_, old), (_, new) = original.prefill(prompts), inplace.prefill(prompts)
    tokens = np.array([5, 6, 7])
    inplace.step(new, tokens), original.step(old, tokens)
    binding, keys = new.step_binding, new.keys[0]
    for steps in range(1, 2 * CAPACITY_STEP + 1):
        np.testing.assert_allclose(inplace.step(new, tokens), original.step(old, tokens), atol=LOGIT_TOLERANCE)
        if new.keys[0] is not keys:
            break
        assert new.step_binding is binding
    assert new.keys[0] is not keys and new.step_binding is not binding, f"no growth in {steps} steps"
    binding = new.step_binding
    for engine, cache in ((inplace, new), (original, old)):
        engine.select(cache, np.array([2, 0, 1]))  # every row moves: gathered into fresh buffers
    np.testing.assert_allclose(inplace.step(new, tokens), original.step(old, tokens), atol=LOGIT_TOLERANCE)
    assert new.step_binding is not binding


def test_gpt_select_concatenate_recycle_keep_their_meaning(engines):
    original, inplace = engines["gpt"]
    prompts = _prompts(original)
    states = []
    for engine in (original, inplace):
        _, a = engine.prefill(prompts[:2])
        tokens = np.array([5, 6])
        for _ in range(3):
            engine.step(a, tokens)
        _, b = engine.prefill(prompts[2:])
        engine.step(b, np.array([7]))
        merged = engine.concatenate([a, b], rows=[np.array([1, 0]), None])
        engine.select(merged, np.array([0, 0, 2]))  # a beam takes over its neighbour's row
        engine.recycle(merged, np.array([1]))
        states.append((engine, merged))
    for _ in range(CAPACITY_STEP):
        tokens = np.array([8, 9, 10])
        (engine_a, a), (engine_b, b) = states
        np.testing.assert_allclose(engine_b.step(b, tokens), engine_a.step(a, tokens), atol=LOGIT_TOLERANCE)
        engine_a.select(a, np.array([1, 0, 2]))
        engine_b.select(b, np.array([1, 0, 2]))


def test_a_batch_that_loses_a_row_and_is_joined_in_its_own_buffers_steps_each_row_as_alone(engines):
    """The continuous batcher's departure and join on the in-place graph: the running batch closes up in its own
    buffers and takes the newcomer into them (`KVCache.concatenate(..., in_place=True)`), and every row's logits
    stay bit-identical to its decoding alone, through the buffers' growth after."""
    engine = engines["gpt"][1]
    prompts = _prompts(engine)
    depart, join, steps = 3, 5, STEPS

    def alone(prompt, count):
        logits, cache = engine.prefill([prompt])
        seen = []
        for _ in range(count):
            seen.append(logits[0])
            logits = engine.step(cache, logits.argmax(-1))
        return seen

    logits, state = engine.prefill(prompts)
    rows, seen = [0, 1, 2], {0: [], 1: [], 2: [], "new": []}
    for step in range(steps):
        if step == depart:  # the second request finishes
            state = engine.select(state, np.array([0, 2]))
            logits, rows = logits[[0, 2]], [0, 2]
            storage = state.storage
        if step == join:  # a new request (the shortest prompt again: it fits in the buffers' slots) joins
            joining, other = engine.prefill([prompts[0]])
            joined = engine.concatenate([state, other])
            assert joined is state and joined.storage is storage  # in the batch's own buffers
            logits, rows = np.concatenate([logits, joining]), [0, 2, "new"]
        for row, name in enumerate(rows):
            seen[name].append(logits[row])
        logits = engine.step(state, logits.argmax(-1))
    assert state.storage is not storage  # grown since: the growth keeps room for rows
    for name, prompt, count in ((0, prompts[0], steps), (2, prompts[2], steps), (1, prompts[1], depart),
                                ("new", prompts[0], steps - join)):
        np.testing.assert_array_equal(np.stack(seen[name]), np.stack(alone(prompt, count)), err_msg=str(name))


@pytest.mark.parametrize("search", [lambda eos: GreedySearch(30, eos), lambda eos: BeamSearch(3, 30, eos)],
                         ids=["greedy", "beam"])
def test_gpt_generations_are_identical(engines, search):
    original, inplace = engines["gpt"]
    prompts = _prompts(original)
    eos = original.eos_id
    outputs = [[s.results()[0].tokens for s in e.generate(prompts, lambda i: search(eos))] for e in (original, inplace)]
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("search", [lambda eos: GreedySearch(30, eos), lambda eos: BeamSearch(4, 30, eos)],
                         ids=["greedy", "beam"])
def test_translations_are_identical(engines, search):
    original, inplace = engines["translation"]
    sources = [original.source_ids(s) for s in GERMAN]
    eos = original.eos_id
    outputs = [[s.results()[0].tokens for s in e.translate_ids(sources, lambda i: search(eos))]
               for e in (original, inplace)]
    assert outputs[0] == outputs[1]


def test_translation_steps_match_the_original_graph(engines):
    original, inplace = engines["translation"]
    sources = [original.source_ids(s) for s in GERMAN]
    (expected, old), (logits, new) = original.prefill(sources), inplace.prefill(sources)
    np.testing.assert_allclose(logits, expected, atol=LOGIT_TOLERANCE)
    for _ in range(STEPS):
        tokens = expected.argmax(-1)
        expected, logits = original.step(old, tokens), inplace.step(new, tokens)
        np.testing.assert_allclose(logits, expected, atol=LOGIT_TOLERANCE)
    assert new.cache.buffered and new.cache.length == old.cache.length


@pytest.mark.parametrize("order", ["before", "after"])
def test_the_rewrite_composes_with_attention_fusion(tiny_repository, tmp_path, order):
    repository = _repository(tiny_repository, tmp_path, fuse=order)
    reference = GPTEngine(ModelRepository(tiny_repository).get("gpt"))
    engine = GPTEngine(repository.get("gpt"))
    model = onnx.load(str(engine.model.path / schema.DECODER_STEP_FILE))
    assert Counter(node.op_type for node in model.graph.node)["MultiHeadAttention"] == engine.n_layers
    prompts = _prompts(engine)
    (expected, old), (logits, new) = reference.prefill(prompts), engine.prefill(prompts)
    for _ in range(STEPS):
        tokens = expected.argmax(-1)
        expected, logits = reference.step(old, tokens), engine.step(new, tokens)
        np.testing.assert_allclose(logits, expected, atol=LOGIT_TOLERANCE)
    translation = TranslationEngine(repository.get("translation"))
    sources = [translation.source_ids(s) for s in GERMAN]
    reference = TranslationEngine(ModelRepository(tiny_repository).get("translation"))
    eos = reference.eos_id
    outputs = [[s.results()[0].tokens for s in e.translate_ids(sources, lambda i: GreedySearch(20, eos))]
               for e in (reference, translation)]
    assert outputs[0] == outputs[1]


def test_a_step_graph_with_one_slot_for_all_rows_is_refused_with_the_fix(tiny_repository, tmp_path):
    """A step graph of the earlier export (one `cache_slot` scalar shared by every row) cannot keep rows where they
    would be alone: the engine refuses it by name instead of failing at the first step."""
    from service.engines.iobinding import InPlaceStep
    from service.engines.runtime import create_session

    version = tmp_path / "gpt" / "1"
    shutil.copytree(tiny_repository / "gpt" / "1", version)
    config = json.loads((version / "config.json").read_text())
    add_step_graph(version, config)
    model = onnx.load(str(version / schema.DECODER_STEP_FILE))
    slot = next(i for i in model.graph.input if i.name == schema.CACHE_SLOT)
    del slot.type.tensor_type.shape.dim[:]  # the earlier interface: a scalar
    reshape = next(n for n in model.graph.node if n.name == "kv_inplace/slot")
    single = onnx.numpy_helper.from_array(np.ones(4, np.int64), "kv_inplace/single")
    model.graph.initializer.append(single)
    reshape.input[1] = single.name
    onnx.save(model, str(version / schema.DECODER_STEP_FILE))
    with pytest.raises(ValueError, match="one slot per row"):
        InPlaceStep(create_session(version / schema.DECODER_STEP_FILE), 257)
