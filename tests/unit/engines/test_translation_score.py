"""Forced decoding with the translator (`TranslationEngine.score_ids`, CTranslate2's `score_batch`) on the tiny
model: the oracles are the greedy search (scoring its output gives its score, token by token) and the PyTorch model
it was exported from (teacher-forced log-softmax); the one-pass and the stepped (in-place graph) paths agree, and
a target's scores do not depend on the batch it is scored in."""

import json
import shutil

import numpy as np
import pytest

from export.kv_inplace import add_step_graph
from models.data import load_multi30k
from service.decoding import GreedySearch
from service.engines import translation
from service.engines.translation import TranslationEngine
from service.repository import ModelRepository

pytestmark = pytest.mark.slow

VALIDATION_PAIRS = 12  # Multi30k validation pairs of the fixtures scored by each test
GREEDY_TOLERANCE = 1e-4  # |score of the greedy output - the greedy search's sum of log-probs|, the bound
TORCH_TOLERANCE = 1e-4  # per token: ONNX Runtime's float32 kernels vs PyTorch's
PATHS_TOLERANCE = 1e-5  # per token: the same graph fed all positions at once vs one step at a time
SHUFFLES = 5  # shuffled versions of each greedy output that must score lower
SEED = 21


@pytest.fixture(scope="module")
def engine(tiny_repository):
    return TranslationEngine(ModelRepository(tiny_repository).get("translation"))


@pytest.fixture(scope="module")
def stepped_engine(tiny_repository, tmp_path_factory):
    """The tiny translator with only the in-place step graph (what `export.convert --kv-cache inplace` leaves)."""
    root = tmp_path_factory.mktemp("inplace")
    version = root / "translation" / "1"
    shutil.copytree(tiny_repository / "translation" / "1", version)
    config = json.loads((version / "config.json").read_text())
    add_step_graph(version, config)
    (version / "config.json").write_text(json.dumps(config))
    return TranslationEngine(ModelRepository(root).get("translation"))


@pytest.fixture(scope="module")
def pairs(data_dir):
    return load_multi30k(data_dir, "val")[:VALIDATION_PAIRS]


@pytest.fixture(scope="module")
def greedy(engine, pairs):
    """(source ids, the greedy search's hypothesis with its recorded log-probs) per validation sentence."""
    sources = [engine.source_ids(de) for de, _ in pairs]
    searches = engine.translate_ids(sources, lambda i: GreedySearch(
        engine.default_max_new_tokens(len(sources[i])), engine.eos_id, prefix=[engine.bos_id], logprobs=0))
    return sources, [s.results()[0] for s in searches]


def _targets(engine, pairs):
    return [engine.tokenizer.encode(en).ids for _, en in pairs]


def test_scoring_the_greedy_output_gives_the_greedy_searchs_log_probs(engine, greedy):
    sources, hypotheses = greedy
    ended = [h.finish_reason == "eos" for h in hypotheses]
    assert sum(ended) >= len(hypotheses) // 2, ended
    scores = engine.score_ids(sources, [h.tokens for h in hypotheses], range(len(sources)))
    for hypothesis, logprobs, eos in zip(hypotheses, scores, ended):
        assert len(logprobs) == len(hypothesis.tokens) + 1  # every token, then EOS
        # the search's score counts EOS only when it chose it; ours always does (the target ends there)
        assert abs((logprobs.sum() if eos else logprobs[:-1].sum()) - hypothesis.score) < GREEDY_TOLERANCE
        np.testing.assert_allclose(logprobs[:-1], [t.logprob for t in hypothesis.logprobs], atol=GREEDY_TOLERANCE)


def test_scores_are_the_pytorch_models_teacher_forced_log_softmax(engine, tiny_runs, pairs):
    import torch

    from models.runs import load_trained

    _, model, *_ = load_trained(tiny_runs["translation"])
    sources, targets = [engine.source_ids(de) for de, _ in pairs], _targets(engine, pairs)
    scores = engine.score_ids(sources, targets, range(len(sources)))
    for source, target, logprobs in zip(sources, targets, scores):
        src, tgt = torch.tensor([source]), torch.tensor([[engine.bos_id, *target]])
        with torch.no_grad():
            logits = model(src, tgt, torch.ones_like(src, dtype=torch.bool), torch.ones_like(tgt, dtype=torch.bool))
        expected = torch.log_softmax(logits[0].double(), -1)[torch.arange(len(target) + 1),
                                                             torch.tensor([*target, engine.eos_id])]
        np.testing.assert_allclose(logprobs, expected.numpy(), atol=TORCH_TOLERANCE)


def test_the_greedy_output_outscores_its_shuffles(engine, greedy):
    """A property of any sensible model and scorer, over every validation sentence: the model's own greedy output
    is more likely than the same tokens in another order."""
    sources, hypotheses = greedy
    rng = np.random.default_rng(SEED)
    shuffles, rows, best = [], [], []
    for row, hypothesis in enumerate(hypotheses):
        tokens = list(hypothesis.tokens)
        for _ in range(SHUFFLES):
            shuffled = list(rng.permutation(tokens))
            if shuffled != tokens:  # a permutation of repeated tokens may be the output itself
                shuffles.append(shuffled)
                rows.append(row)
    assert len(set(rows)) == len(hypotheses)  # every sentence has shuffles that differ from its output
    greedy_scores = [s.sum() for s in engine.score_ids(sources, [h.tokens for h in hypotheses], range(len(sources)))]
    for row, logprobs in zip(rows, engine.score_ids(sources, shuffles, rows)):
        best.append(greedy_scores[row] > logprobs.sum())
    assert all(best), f"{best.count(False)} of {len(best)} shuffles scored at least as high as the greedy output"


def test_one_pass_and_steps_through_the_in_place_graph_agree(engine, stepped_engine, pairs):
    assert engine.decoder is not None and stepped_engine.decoder is None  # the two paths of score_ids
    sources, targets = [engine.source_ids(de) for de, _ in pairs], _targets(engine, pairs)
    for one_pass, stepped in zip(engine.score_ids(sources, targets, range(len(sources))),
                                 stepped_engine.score_ids(sources, targets, range(len(sources)))):
        np.testing.assert_allclose(stepped, one_pass, atol=PATHS_TOLERANCE)


def test_a_targets_scores_do_not_depend_on_its_batch_nor_on_the_passes(engine, pairs, monkeypatch):
    sources, targets = [engine.source_ids(de) for de, _ in pairs], _targets(engine, pairs)
    batched = engine.score_ids(sources, targets, range(len(sources)))
    alone = [engine.score_ids([source], [target], [0])[0] for source, target in zip(sources, targets)]
    runs = []
    monkeypatch.setattr(translation, "SCORE_PASS_LOGITS", 1)  # one target per decoder pass
    one_each = engine.score_ids(sources, targets, range(len(sources)), before_run=lambda: runs.append(1))
    assert len(runs) == 1 + len(targets)  # the encoder's run, then one decoder pass per target
    for a, b, c in zip(batched, alone, one_each):
        np.testing.assert_allclose(a, b, atol=PATHS_TOLERANCE)
        np.testing.assert_allclose(c, b, atol=PATHS_TOLERANCE)


def test_targets_sharing_a_source_score_as_pairs_with_that_source(engine, pairs):
    source, targets = engine.source_ids(pairs[0][0]), _targets(engine, pairs[:4])
    shared = engine.score_ids([source], targets, [0] * len(targets))
    paired = engine.score_ids([source] * len(targets), targets, range(len(targets)))
    for a, b in zip(shared, paired):
        np.testing.assert_allclose(a, b, atol=PATHS_TOLERANCE)
    # and a target's scores are its own source's: another source changes them
    other = engine.score_ids([engine.source_ids(pairs[1][0])], targets[:1], [0])[0]
    assert np.abs(other - shared[0]).max() > PATHS_TOLERANCE


def test_what_before_run_raises_stops_the_work(engine, stepped_engine, pairs):
    source, target = engine.source_ids(pairs[0][0]), _targets(engine, pairs[:1])[0]
    for scorer, runs_before_stop in ((engine, 2), (stepped_engine, 3)):
        calls = []

        def before_run():
            calls.append(1)
            if len(calls) == runs_before_stop:
                raise TimeoutError("stop")

        with pytest.raises(TimeoutError):
            scorer.score_ids([source], [target], [0], before_run)
        assert len(calls) == runs_before_stop


def test_a_target_longer_than_the_positional_table_is_refused(engine):
    most = engine.max_target_length - 1
    assert len(engine.score_ids([engine.source_ids("Hallo.")], [[5] * most], [0])[0]) == most + 1
    with pytest.raises(ValueError, match=f"{most + 1} tokens"):
        engine.score_ids([engine.source_ids("Hallo.")], [[5] * (most + 1)], [0])
