"""Verifying draft tokens on the released GPT (`service.engines.speculation`, `GPTEngine.verify`): the verify pass's
logits are a prompt pass's over the same text, bit for bit; a commit keeps exactly the accepted tokens (the cache
equals one whose prompt held them, nothing of the rejected ones left); greedy outputs through the running batch
with speculation on equal plain decoding's on copy-heavy prompts under fp32 (int8's verify pass differs from its
steps by more: bench/speculation_flips.py measures where outputs differ); int8 caches and device caches are not
speculated."""

from __future__ import annotations

import time

import numpy as np
import pytest

from service.decoding import GreedySearch, StopStrings
from service.engines.gpt import GPTEngine
from service.engines.runtime import RuntimeOptions
from service.repository import ModelRepository
from service.scheduling.jobs import TextJob
from service.scheduling.speculation import SpeculationConfig
from service.scheduling.text_batch import TextBatch
from tests.support import ROOT

RELEASE = ROOT / "model_repository"
PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?"
# prompts whose greedy continuations repeat their own lines: drafts are accepted, tokens come out of verify passes
COPY_PROMPTS = ["LUCIO:\nI will be so.\n\n" * 4 + "LUCIO:\nI will", "GREMIO:\nI will be so.\n\n" * 3 + "GREMIO:\nI",
                "And the sea the seat of the sea,\nAnd the sea the seat of the sea,\nAnd the sea"]
DEADLINE_S = 600.0
LOGPROB_ATOL = 1e-4  # fp32's verify pass and steps: logits apart by ~1e-5 (docs/speculation.md)


@pytest.fixture(scope="module", params=["fp32", "int8"])
def engine(request) -> GPTEngine:
    return GPTEngine(ModelRepository(RELEASE).get("gpt"), RuntimeOptions(weights=request.param))


@pytest.fixture(scope="module")
def fp32() -> GPTEngine:
    return GPTEngine(ModelRepository(RELEASE).get("gpt"), RuntimeOptions(weights="fp32"))


def ids(engine: GPTEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text).ids


@pytest.mark.parametrize("buffered", [False, True])
def test_the_verify_pass_gives_a_prompt_pass_logits_bit_for_bit(engine, buffered):
    prompt = ids(engine, PROMPT)
    fed = ids(engine, " Juliet is the sun")
    _, cache = engine.prefill([prompt])
    if buffered:
        cache.reserve(1)  # the in-place step's buffers, each row's slots from 0
    verification = engine.verify(cache, [fed])
    _, _, every = engine.prefill_positions([prompt + fed], [0])
    np.testing.assert_array_equal(verification.logits[0], every[0][len(prompt):])


@pytest.mark.parametrize("buffered", [False, True])
def test_a_commit_keeps_the_accepted_tokens_and_nothing_of_the_rejected_ones(engine, buffered):
    # rows of one length: the pass feeds every row's new tokens after the longest row's past, so a shorter row's
    # new slots sit elsewhere than in its own prompt pass, and may differ from it in the last bits
    prompts = [ids(engine, PROMPT), ids(engine, PROMPT.replace("ROMEO", "JULIET")[1:])]
    assert len(prompts[0]) == len(prompts[1])
    fed = [ids(engine, " Juliet is the sun"), ids(engine, " say you")]
    kept = np.array([5, 2])
    _, cache = engine.prefill(prompts)
    if buffered:
        cache.reserve(1)
    engine.verify(cache, fed).commit(kept)
    assert cache.positions.tolist() == [len(p) + k for p, k in zip(prompts, kept)]
    for row, (prompt, tokens, count) in enumerate(zip(prompts, fed, kept)):
        _, alone = engine.prefill([prompt + tokens[:count]])  # the cache its prompt would have made
        used = cache.mask[row].astype(bool)
        assert used.sum() == len(prompt) + count
        for got, want in zip((*cache.keys, *cache.values), (*alone.keys, *alone.values)):
            np.testing.assert_array_equal(got[row][:, used], want[0])
        if buffered:  # in the buffers, every row's tokens from slot 0 and zeros after
            assert cache.lengths[row] == len(prompt) + count and used[: cache.lengths[row]].all()
            assert not any(array[row][:, ~used].any() for array in (*cache.keys, *cache.values))


def test_committed_rows_step_on_as_if_they_had_never_been_fed_the_rejected_tokens(fp32):
    prompt, fed = ids(fp32, PROMPT), ids(fp32, " Juliet is the sun")
    _, cache = fp32.prefill([prompt])
    fp32.step(cache, np.array([fed[0]]))  # the in-place step's buffers
    verification = fp32.verify(cache, [fed[1:]])
    verification.commit(np.array([3]))
    _, other = fp32.prefill([prompt])
    fp32.step(other, np.array([fed[0]]))
    fp32.verify(other, [fed[1:4]]).commit(np.array([3]))
    np.testing.assert_array_equal(fp32.step(cache, np.array([7])), fp32.step(other, np.array([7])))
    assert cache.length == other.length == len(prompt) + 5


def decode(engine: GPTEngine, prompts: list[str], speculation: SpeculationConfig | None, **search) -> list:
    """Greedy continuations of `prompts` in one running batch -> each job's (tokens, score, finish reason,
    log-probabilities), and the draft tokens accepted."""
    jobs = [TextJob(ids(engine, p), GreedySearch(eos_token_id=engine.eos_id, **search), "greedy",
                    time.monotonic() + DEADLINE_S) for p in prompts]
    batch, generations = TextBatch.prefill(engine, jobs)
    batch.speculation = speculation
    accepted = 0
    while True:
        assert all(g.error is None for g in generations)
        batch.filter([g.job for g in generations if not g.done])
        if not batch.jobs:
            break
        generations = batch.generate_token()
        accepted += sum(g.accepted for g in generations)
    results = [[(h.tokens, h.score, h.finish_reason, h.logprobs) for h in job.search.results()] for job in jobs]
    return results, accepted


@pytest.mark.parametrize("rows", [1, 2])
def test_greedy_outputs_with_speculation_equal_plain_decoding_on_copy_heavy_prompts(fp32, rows):
    config = SpeculationConfig(max_rows=rows)
    for first in range(0, len(COPY_PROMPTS), rows):
        prompts = COPY_PROMPTS[first : first + rows]
        plain, _ = decode(fp32, prompts, None, max_new_tokens=96, logprobs=2)
        speculative, accepted = decode(fp32, prompts, config, max_new_tokens=96, logprobs=2)
        for (got,), (want,) in zip(speculative, plain):
            assert (got[0], got[2]) == (want[0], want[2])  # the tokens and the finish reason
            # the score and log-probabilities: the same but for the last bits (another pass, the same model)
            np.testing.assert_allclose([got[1], *(t.logprob for t in got[3])], [want[1], *(t.logprob for t in want[3])],
                                       rtol=0, atol=LOGPROB_ATOL)
        assert accepted > 40 * len(prompts)  # tokens came out of verify passes


@pytest.mark.parametrize("end", ["stop", "length"])
def test_stop_strings_and_max_new_tokens_inside_a_draft_end_as_in_plain_decoding(fp32, end):
    prompt = COPY_PROMPTS[0]
    if end == "stop":  # its continuation holds this once, ending at its 88th token, after accepted drafts
        stop = StopStrings(["LUCIO:\nI will be so.\n\nDUKE"], fp32.tokenizer.decode)
        search = {"max_new_tokens": 120, "stop_checker": stop}
    else:
        search = {"max_new_tokens": 37}
    plain, _ = decode(fp32, [prompt], None, **search)
    speculative, accepted = decode(fp32, [prompt], SpeculationConfig(max_rows=1), **search)
    assert (speculative[0][0][0], speculative[0][0][2]) == (plain[0][0][0], plain[0][0][2]) and accepted > 0
    assert plain[0][0][2] == end


@pytest.mark.parametrize("options", [RuntimeOptions(weights="int8+gqa+kv8"), RuntimeOptions(kv_residence="device")])
def test_int8_caches_and_device_caches_are_not_speculated(options):
    assert not GPTEngine(ModelRepository(RELEASE).get("gpt"), options).speculates


def test_float_host_caches_are(engine):
    assert engine.speculates
