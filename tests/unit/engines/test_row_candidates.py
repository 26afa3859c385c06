"""The translator's decoder graphs compute each row's most likely tokens (`service.engines.row_candidates`): the
derived graph's top-k is the float32 log-softmax of its own logits, best first; its k defaults to none; and beam
translations chosen among those tokens are the translations the whole-logits path (float64 numpy) gives."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from service.decoding import BeamSearch, run_search
from service.decoding.distributions import log_softmax
from service.engines import onnx_schema as schema
from service.engines.translation import TranslationEngine
from service.engines.weights import derive
from service.repository import ModelRepository

GERMAN = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau in einem roten Kleid singt.",
          "Kinder spielen am Strand.", "Ein alter Mann liest eine Zeitung im Park."]
# float32 log-softmax (ONNX Runtime) against float64 numpy of the same float32 logits: a few float32 ulps of values
# of magnitude up to ~20
LOGPROB_TOLERANCE = 1e-5
SCORE_TOLERANCE = 1e-4  # a hypothesis' score sums its tokens' log-probs (~30 of them)


@pytest.fixture(scope="module")
def engine(tiny_repository):
    return TranslationEngine(ModelRepository(tiny_repository).get("translation"))


def test_the_graph_returns_each_rows_best_tokens_of_its_own_logits(engine):
    sources = [engine.source_ids(s) for s in GERMAN]
    batch_logits, batch = engine.prefill(sources)
    tokens = np.asarray(batch_logits).argmax(-1)
    step = engine.step(batch, tokens, candidates=7)
    assert step.top_ids.shape == step.top_logprobs.shape == (len(sources), 7)
    expected = log_softmax(step.logits)
    order = np.argsort(-step.logits, axis=-1, kind="stable")[:, :7]  # ties by lower id, as ONNX TopK
    np.testing.assert_array_equal(step.top_ids, order)
    np.testing.assert_allclose(step.top_logprobs, np.take_along_axis(expected, order, -1), atol=LOGPROB_TOLERANCE)


def test_without_a_k_the_graph_computes_no_candidates(engine):
    graph = derive(engine.model.path / engine.model.config["files"]["decoder"], None, row_candidates=True)
    session = ort.InferenceSession(graph, providers=["CPUExecutionProvider"])
    assert schema.CANDIDATES_K not in {i.name for i in session.get_inputs()}  # optional: its default is 0
    assert schema.CANDIDATES_K in {i.name for i in session.get_overridable_initializers()}
    logits, batch = engine.prefill([engine.source_ids(GERMAN[0])])
    assert isinstance(logits, np.ndarray)  # asked for none: plain logits


@pytest.mark.parametrize("num_beams", [2, 4])
def test_beams_on_the_graphs_candidates_translate_as_on_the_whole_logits(engine, num_beams):
    sources = [engine.source_ids(s) for s in GERMAN]

    def search(i: int) -> BeamSearch:
        return BeamSearch(num_beams, engine.default_max_new_tokens(len(sources[i])), engine.eos_id,
                          length_penalty=1.2, no_repeat_ngram_size=3 if i % 2 else 0)

    on_candidates = engine.translate_ids(sources, search)
    on_logits = [search(i) for i in range(len(sources))]
    logits, batch = engine.prefill(sources)  # no candidates asked for: every step reads the logits
    run_search(on_logits, list(logits), lambda tokens, parents: engine.step(engine.select(batch, parents), tokens))
    for a, b in zip(on_candidates, on_logits):
        assert [h.tokens for h in a.results()] == [h.tokens for h in b.results()]
        np.testing.assert_allclose([h.score for h in a.results()], [h.score for h in b.results()],
                                   atol=SCORE_TOLERANCE)
