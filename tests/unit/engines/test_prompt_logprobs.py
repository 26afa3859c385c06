"""Prompt log-probabilities from the GPT's prompt pass (`GPTEngine.prefill_positions` + `score_prompt`), against
oracles: a full forward pass of the same ONNX graph on each prompt alone, and the PyTorch model on the same ids.
For every served variant of the GPT: the tiny float model, the released version as float32 (its int8 weights
dequantised when the graphs load) and as stored (int8 MatMulNBits weights, fused attention, in-place KV step graph
with IO binding; the prompt pass runs decoder.onnx in every variant). A graph that keeps the last position only
cannot score prompts, and says so.
The batch (`TextBatch.prefill`) scores the prompts of the jobs that asked only, in the pass every newcomer shares.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from service.decoding import GreedySearch
from service.decoding.distributions import log_softmax
from service.engines import onnx_schema as schema
from service.engines.gpt import GPTEngine
from service.engines.runtime import RuntimeOptions
from service.engines.weights import FP32
from service.errors import BadInput
from service.repository import ModelRepository
from service.scheduling.jobs import TextJob
from service.scheduling.text_batch import TextBatch, score_prompt
from service.serving.generate import GenerationParams, ScoreOnly, check_prompt_scoring
from tests.support import ROOT

pytestmark = pytest.mark.slow

RELEASE_REPOSITORY = ROOT / "model_repository"
PROMPTS = ["ROMEO:\nWhat light", "O", "First Citizen:\nBefore we proceed any further, hear me speak.", "KING"]
TOP = 5
SERVED = "release served (highest version: int8 + mha + in-place)"
FLOAT = "release as float32 (the fp32 variant)"
# The same graph, the row alone vs right-padded in a batch: the rows' real positions never see the padding
# (causal attention), so the numbers agree to float32 rounding of reductions grouped differently.
ONNX_TOLERANCE = 1e-5
TORCH_TOLERANCE = 1e-4  # ONNX Runtime's kernels vs PyTorch's, float32


def _engines(tiny_repository) -> dict[str, GPTEngine]:
    release = ModelRepository(RELEASE_REPOSITORY)
    return {"tiny": GPTEngine(ModelRepository(tiny_repository).get("gpt")),
            FLOAT: GPTEngine(release.get("gpt"), RuntimeOptions(weights=FP32)),
            SERVED: GPTEngine(release.get("gpt"))}


@pytest.fixture(scope="module")
def engines(tiny_repository) -> dict[str, GPTEngine]:
    return _engines(tiny_repository)


def _alone(engine: GPTEngine, prompt: list[int]) -> np.ndarray:
    """log-softmax of the graph's logits at every position of `prompt` fed alone, no padding: (T, V) float64."""
    ids = np.array([prompt], np.int64)
    feeds = {schema.INPUT_IDS: ids, schema.POSITION_IDS: np.arange(len(prompt))[None],
             schema.ATTENTION_MASK: np.ones_like(ids)}
    for i in range(engine.n_layers):
        for name in schema.past_names(i):
            feeds[name] = np.zeros((1, engine.n_heads, 0, engine.head_dim), np.float32)
    return log_softmax(engine.session.run(None, feeds)[0][0])


def _ids(engine: GPTEngine) -> list[list[int]]:
    return [engine.tokenizer.encode(p).ids for p in PROMPTS]


@pytest.mark.parametrize("variant", ["tiny", FLOAT, SERVED])
def test_every_variant_scores_prompts_as_a_full_forward_pass_of_each_prompt_alone(engines, variant):
    engine = engines[variant]
    assert engine.scores_prompts
    prompts = _ids(engine)
    scored = [0, 2, 3]  # row 1 ("O", one token) is not asked: it costs nothing and gets nothing
    last, cache, every = engine.prefill_positions(prompts, scored)
    assert sorted(every) == scored
    plain_last, plain_cache = engine.prefill(prompts)
    np.testing.assert_array_equal(last, plain_last)  # the same pass: the generation does not change
    np.testing.assert_array_equal(cache.mask, plain_cache.mask)
    for row in scored:
        prompt = prompts[row]
        scores = score_prompt(prompt, every[row], TOP)
        reference = _alone(engine, prompt)  # (T, V)
        assert len(scores.tokens) == len(prompt) - 1
        expected = reference[np.arange(len(prompt) - 1), prompt[1:]]
        np.testing.assert_allclose([lp.logprob for lp in scores.tokens], expected, atol=ONNX_TOLERANCE, rtol=0)
        assert [lp.token_id for lp in scores.tokens] == prompt[1:]
        for t, lp in enumerate(scores.tokens):
            order = np.argsort(-reference[t], kind="stable")
            assert len(lp.top) == TOP
            np.testing.assert_allclose([v for _, v in lp.top], reference[t][order[:TOP]], atol=ONNX_TOLERANCE, rtol=0)
            own = reference[t][prompt[t + 1]]  # its rank: 1 + the tokens more likely (near-ties either way)
            above = [int(np.count_nonzero(reference[t] > own + side * ONNX_TOLERANCE)) for side in (1, -1)]
            assert 1 + above[0] <= scores.ranks[t] <= 1 + above[1]
        # the last position's logits are the ones the first generated token is chosen from
        np.testing.assert_allclose(log_softmax(last[row]), reference[-1], atol=ONNX_TOLERANCE, rtol=0)


def test_the_tiny_model_scores_prompts_as_the_pytorch_model(engines, tiny_runs):
    torch = pytest.importorskip("torch")
    from models.runs import load_trained

    _, model, *_ = load_trained(tiny_runs["gpt"])
    engine = engines["tiny"]
    prompts = _ids(engine)
    _, _, every = engine.prefill_positions(prompts, range(len(prompts)))
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            logits, _ = model(torch.tensor([prompt]))
        reference = torch.log_softmax(logits[0].double(), dim=-1).numpy()
        scores = score_prompt(prompt, every[row], 1)
        np.testing.assert_allclose([lp.logprob for lp in scores.tokens],
                                   reference[np.arange(len(prompt) - 1), prompt[1:]], atol=TORCH_TOLERANCE, rtol=0)


def test_the_most_likely_token_has_exactly_the_top_alternative_s_log_probability(engines):
    """What lm-eval's `is_greedy` compares (`token_logprob == max(top_logprobs.values())`): bit for bit."""
    engine = engines["tiny"]
    prompt = _ids(engine)[2]
    _, _, every = engine.prefill_positions([prompt], [0])
    scores = score_prompt(prompt, every[0], 1)
    greedy = [t for t, rank in enumerate(scores.ranks) if rank == 1]
    assert greedy and len(greedy) < len(scores.ranks)  # the tiny model predicts some of the tokens, not all
    for t, (lp, rank) in enumerate(zip(scores.tokens, scores.ranks)):
        top_id, top_value = lp.top[0]
        assert (lp.logprob == top_value) == (rank == 1)
        assert (top_id == lp.token_id) == (rank == 1)
    assert score_prompt(prompt, every[0], 0).tokens[0].top == []


def test_a_one_token_prompt_has_nothing_to_score(engines):
    engine = engines["tiny"]
    _, _, every = engine.prefill_positions([[65]], [0])
    scores = score_prompt([65], every[0], 3)
    assert scores.tokens == [] and scores.ranks == []


def _last_position_only(source, target) -> None:
    """A copy of the tiny decoder graph whose logits keep the last position only (rows, 1, V)."""
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(source))
    graph = model.graph
    logits = next(o for o in graph.output if o.name == schema.LOGITS)
    vocab = logits.type.tensor_type.shape.dim[2].dim_value
    for node in graph.node:  # the graph's own logits become an inner value
        node.output[:] = ["logits_all" if name == schema.LOGITS else name for name in node.output]
    graph.initializer.extend([helper.make_tensor(name, TensorProto.INT64, [1], [value]) for name, value in
                              (("last_start", -1), ("last_end", 2**62), ("last_axis", 1))])
    graph.node.append(helper.make_node("Slice", ["logits_all", "last_start", "last_end", "last_axis"],
                                       [schema.LOGITS]))
    graph.output.remove(logits)
    graph.output.insert(0, helper.make_tensor_value_info(schema.LOGITS, TensorProto.FLOAT, ["batch", 1, vocab]))
    onnx.save(model, str(target))


def test_a_graph_with_the_last_position_only_cannot_score_prompts(tiny_repository_copy):
    repository = tiny_repository_copy("last-position-only", ("gpt",))
    decoder = repository / "gpt" / "1" / "decoder.onnx"
    _last_position_only(decoder, decoder)
    engine = GPTEngine(ModelRepository(repository).get("gpt"))
    assert not engine.scores_prompts
    loaded = SimpleNamespace(engine=engine, name="gpt", version=1)
    with pytest.raises(BadInput, match="cannot score prompts") as refused:  # the serving layer refuses: a 400
        check_prompt_scoring(loaded, GenerationParams(max_new_tokens=1, prompt_logprobs=1))
    assert refused.value.param == "logprobs"
    check_prompt_scoring(loaded, GenerationParams(max_new_tokens=1))  # not asked: nothing to refuse
    with pytest.raises(ValueError, match="cannot score prompts"):  # and its prompt pass never hands out a wrong number
        engine.prefill_positions(_ids(engine), [0])


def test_the_batch_scores_only_the_prompts_of_the_jobs_that_asked(engines):
    """`TextBatch.prefill`: one pass for every newcomer; the jobs with `prompt_logprobs` get their scores before
    their first step is handed back, the others none; a score-only job is done on the pass, nothing generated."""
    engine = engines["tiny"]
    prompts = _ids(engine)
    searches = [GreedySearch(4, engine.eos_id), GreedySearch(4, engine.eos_id, logprobs=1), ScoreOnly(1),
                GreedySearch(4, engine.eos_id)]
    asked = [2, None, 0, None]
    jobs = [TextJob(p, s, "greedy", float("inf"), prompt_logprobs=a) for p, s, a in zip(prompts, searches, asked)]
    batch, generations = TextBatch.prefill(engine, jobs)
    for job, top in zip(jobs, asked):
        if top is None:
            assert job.prompt_scores is None
            continue
        _, _, every = engine.prefill_positions([job.input_ids], [0])  # the prompt alone
        expected = score_prompt(job.input_ids, every[0], top)
        assert job.prompt_scores.ranks == expected.ranks
        np.testing.assert_allclose([t.logprob for t in job.prompt_scores.tokens],
                                   [t.logprob for t in expected.tokens], atol=ONNX_TOLERANCE, rtol=0)
        assert [len(t.top) for t in job.prompt_scores.tokens] == [top] * (len(job.input_ids) - 1)
    score_only = generations[2]
    assert score_only.done and score_only.token_ids == []
    assert score_only.hypotheses[0].tokens == [] and score_only.hypotheses[0].finish_reason == "length"
    assert [g.done for g in generations] == [False, False, True, False]
    alone = [GreedySearch(4, engine.eos_id) for _ in prompts]  # the scored pass generates as an unscored one
    _, plain = TextBatch.prefill(engine, [TextJob(p, s, "greedy", float("inf")) for p, s in zip(prompts, alone)])
    assert [g.token_ids for i, g in enumerate(plain) if i != 2] == [g.token_ids for i, g in enumerate(generations)
                                                                   if i != 2]
