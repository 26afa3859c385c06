"""ONNX Runtime engines on the project's own exported tiny models: no torch, KV cache = full recomputation,
beam 1 = greedy, and a sequence's output does not depend on what else is in its batch."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from service.decoding import BeamSearch, GreedySearch, SamplingSearch
from service.engines import onnx_schema as schema
from service.engines.gpt import GPTEngine
from service.engines.translation import TranslationEngine
from service.repository import ModelRepository
from tests.support import ROOT

pytestmark = pytest.mark.slow

GERMAN = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau in einem roten Kleid singt.",
          "Ein kleines Mädchen klettert in ein Spielhaus aus Holz.", "Kinder laufen am Strand."]
PROMPTS = ["ROMEO:\n", "First Citizen:\nBefore we proceed", "To be", "KING RICHARD III:\nNow is the winter"]


@pytest.fixture(scope="module")
def translation_engine(tiny_repository):
    return TranslationEngine(ModelRepository(tiny_repository).get("translation"))


@pytest.fixture(scope="module")
def gpt_engine(tiny_repository):
    return GPTEngine(ModelRepository(tiny_repository).get("gpt"))


def test_the_serving_side_never_imports_torch(tiny_repository):
    sources = ROOT / "service"
    offenders = [p for p in sources.rglob("*.py") if "import torch" in p.read_text() or "from torch" in p.read_text()]
    assert offenders == []
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any `import torch` now raises ImportError
        from PIL import Image
        from service.decoding import GreedySearch
        from service.engines.gpt import GPTEngine
        from service.engines.translation import TranslationEngine
        from service.engines.vit import ViTEngine
        from service.repository import ModelRepository
        repo = ModelRepository({str(tiny_repository)!r})
        t = TranslationEngine(repo.get("translation"))
        out = t.translate_ids([t.source_ids("Ein Hund.")], lambda i: GreedySearch(10, t.eos_id))
        g = GPTEngine(repo.get("gpt"))
        out += g.generate([[65, 66]], lambda i: GreedySearch(5, g.eos_id))
        v = ViTEngine(repo.get("vit"))
        print(len(out), v.classify([Image.new("L", (28, 28))], top_k=3)[0][0][0] in v.labels)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2", "True"]


# --- KV cache vs full recomputation -------------------------------------------------------------------------

def _empty_past(engine, rows):
    return {name: np.zeros((rows, engine.n_heads, 0, engine.head_dim), np.float32)
            for i in range(engine.n_layers) for name in schema.past_names(i)}


def test_gpt_cached_greedy_equals_full_recomputation(gpt_engine):
    engine = gpt_engine
    prompts = [engine.tokenizer.encode(p).ids for p in PROMPTS]
    cached = [s.results()[0].tokens for s in engine.generate(prompts, lambda i: GreedySearch(20, engine.eos_id))]

    for prompt, expected in zip(prompts, cached):
        sequence = list(prompt)
        for _ in range(len(expected)):  # no cache: the whole sequence through the graph every step
            ids = np.array([sequence], np.int64)
            feeds = {schema.INPUT_IDS: ids, schema.POSITION_IDS: np.arange(len(sequence))[None],
                     schema.ATTENTION_MASK: np.ones_like(ids), **_empty_past(engine, 1)}
            sequence.append(int(engine.session.run(None, feeds)[0][0, -1].argmax()))
        assert sequence[len(prompt):] == expected


def test_translation_cached_greedy_equals_full_recomputation(translation_engine):
    engine = translation_engine
    sources = [engine.source_ids(s) for s in GERMAN]
    cached = engine.translate_ids(sources, lambda i: GreedySearch(engine.default_max_new_tokens(len(sources[i])),
                                                                   engine.eos_id))
    for i, source in enumerate(sources):
        encoded = engine.encode([source])
        target = [engine.bos_id]
        expected = cached[i].results()[0]
        for _ in range(len(expected.tokens) + (expected.finish_reason == "eos")):
            ids = np.array([target], np.int64)
            feeds = {schema.INPUT_IDS: ids, schema.POSITION_IDS: np.arange(len(target))[None],
                     schema.ATTENTION_MASK: np.ones_like(ids), schema.ENCODER_ATTENTION_MASK: encoded.mask,
                     schema.ENCODER_ROW: np.zeros(1, np.int64), **_empty_past(engine, 1)}
            for layer in range(engine.n_layers):
                key, value = schema.cross_names(layer)
                feeds[key], feeds[value] = encoded.cross[2 * layer], encoded.cross[2 * layer + 1]
            target.append(int(engine.decoder.run(None, feeds)[0][0, -1].argmax()))
        generated = target[1:]
        if expected.finish_reason == "eos":
            assert generated[-1] == engine.eos_id
            generated = generated[:-1]
        assert generated == expected.tokens


# --- beam 1 = greedy; batch independence --------------------------------------------------------------------

def test_beam_one_equals_greedy(translation_engine, gpt_engine):
    engine = translation_engine
    sources = [engine.source_ids(s) for s in GERMAN]
    greedy = engine.translate_ids(sources, lambda i: GreedySearch(30, engine.eos_id))
    beam = engine.translate_ids(sources, lambda i: BeamSearch(1, 30, engine.eos_id))
    assert [s.results()[0].tokens for s in greedy] == [s.results()[0].tokens for s in beam]
    prompts = [gpt_engine.tokenizer.encode(p).ids for p in PROMPTS]
    greedy = gpt_engine.generate(prompts, lambda i: GreedySearch(16, gpt_engine.eos_id))
    beam = gpt_engine.generate(prompts, lambda i: BeamSearch(1, 16, gpt_engine.eos_id, prefix=prompts[i]))
    assert [s.results()[0].tokens for s in greedy] == [s.results()[0].tokens for s in beam]


@pytest.mark.parametrize("num_beams", [1, 4])
def test_translation_does_not_depend_on_its_batch(translation_engine, num_beams):
    engine = translation_engine
    sources = [engine.source_ids(s) for s in GERMAN]

    def make(i):
        return BeamSearch(num_beams, 30, engine.eos_id, num_return_sequences=min(num_beams, 2))

    batched = engine.translate_ids(sources, make)
    for i, source in enumerate(sources):
        alone = engine.translate_ids([source], make)[0].results()
        together = batched[i].results()
        assert [h.tokens for h in alone] == [h.tokens for h in together]
        assert np.allclose([h.score for h in alone], [h.score for h in together], atol=1e-5)


def test_translation_drops_sources_once_half_are_unused(translation_engine):
    """A finished source stays (its rows gather theirs by index) until half the sources are unused; then they are
    dropped, the rows re-pointed, and each row's next logits are what they would have been."""
    engine = translation_engine
    sources = [engine.source_ids(s) for s in GERMAN[:4]]
    tokens = np.array([5, 6], np.int64)
    _, alone = engine.prefill([sources[0], sources[2]])
    expected = engine.step(alone, tokens)
    _, batch = engine.prefill(sources)  # one row per source
    engine.select(batch, np.array([0, 1, 2]))
    assert batch.encoded.count == 4 and batch.cache.encoder_row.tolist() == [0, 1, 2]
    engine.select(batch, np.array([0, 2]))
    assert batch.encoded.count == 2 and batch.cache.encoder_row.tolist() == [0, 1]
    np.testing.assert_allclose(engine.step(batch, tokens), expected, atol=1e-5)


@pytest.mark.parametrize("search", ["greedy", "beam", "sample"])
def test_generation_does_not_depend_on_its_batch(gpt_engine, search):
    engine = gpt_engine
    prompts = [engine.tokenizer.encode(p).ids for p in PROMPTS]

    def make(i):
        if search == "greedy":
            return GreedySearch(20, engine.eos_id)
        if search == "beam":
            return BeamSearch(3, 20, engine.eos_id, prefix=prompts[i])
        return SamplingSearch(20, engine.eos_id, temperature=0.9, top_k=20, seed=1234 + i)

    batched = engine.generate(prompts, make)
    for i, prompt in enumerate(prompts):
        alone = engine.generate([prompt], lambda _: make(i))[0].results()
        assert [h.tokens for h in alone] == [h.tokens for h in batched[i].results()]


def test_rows_joining_a_running_batch_decode_as_if_alone(gpt_engine):
    """Continuous batching in miniature: a second request's cache joins a running batch at a step boundary."""
    from service.engines.kv_cache import KVCache

    engine = gpt_engine
    first, second = (engine.tokenizer.encode(p).ids for p in PROMPTS[:2])

    def argmax_alone(prompt, n):
        logits, cache = engine.prefill([prompt])
        tokens = [int(logits[0].argmax())]
        while len(tokens) < n:
            tokens.append(int(engine.step(cache, np.array(tokens[-1:]))[0].argmax()))
        return tokens

    logits, cache = engine.prefill([first])
    tokens_a = [int(logits[0].argmax())]
    for _ in range(4):  # the first request runs alone for a while
        tokens_a.append(int(engine.step(cache, np.array(tokens_a[-1:]))[0].argmax()))
    logits_b, cache_b = engine.prefill([second])
    tokens_b = [int(logits_b[0].argmax())]
    cache = KVCache.concatenate([cache, cache_b])
    for _ in range(11):
        logits = engine.step(cache, np.array([tokens_a[-1], tokens_b[-1]]))
        tokens_a.append(int(logits[0].argmax()))
        tokens_b.append(int(logits[1].argmax()))
    cache.select(np.array([1]))  # the first request leaves; the second goes on alone
    for _ in range(3):
        tokens_b.append(int(engine.step(cache, np.array(tokens_b[-1:]))[0].argmax()))
    assert tokens_a == argmax_alone(first, 16)
    assert tokens_b == argmax_alone(second, 15)
