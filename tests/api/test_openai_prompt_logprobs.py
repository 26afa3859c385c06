"""Prompt log-probabilities on `/v1/completions`, through a real server on the tiny GPT, with the `openai` SDK and
lm-eval's own parser: `echo` + `logprobs` (OpenAI's legacy shape, the prompt's tokens first, the first one's null),
`max_tokens: 0` (score only), vLLM's `prompt_logprobs`, token-id prompts, `n` / `best_of` with echo, streams
(echo alone streams; the prompt's log-probabilities are refused there), and the numbers: those of the engine's own
prompt pass on the prompt alone (tests/unit/engines/test_prompt_logprobs.py checks that against a full forward
pass and PyTorch), the same alone and among other requests.

The tiny GPT's context is 64 byte-level tokens, so prompts stay short.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from service.engines.gpt import GPTEngine
from service.engines.runtime import RuntimeOptions
from service.repository import ModelRepository
from service.scheduling.text_batch import score_prompt

pytestmark = pytest.mark.slow

PROMPT = "ROMEO:\nWhat light"
CONTINUATION = " through yonder"
# A float tolerance: the server's prompt pass vs the engine's here (same graph, same ids; ONNX Runtime may group
# its reductions differently with other threads)
TOLERANCE = 1e-5
OTHERS = 8  # requests sent beside the one whose numbers must not change


@pytest.fixture(scope="module")
def server(server_factory):
    with server_factory("prompt logprobs server", models='["gpt"]', max_new_tokens=60) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def engine(tiny_repository) -> GPTEngine:
    """The server's tiny GPT, loaded here too: the reference (its prompt pass on each prompt alone)."""
    return GPTEngine(ModelRepository(tiny_repository).get("gpt"), RuntimeOptions(intra_op_threads=1))


def _reference(engine: GPTEngine, ids: list[int], top: int):
    _, _, every = engine.prefill_positions([ids], [0])
    return score_prompt(ids, every[0], top)


def _post(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"model": "gpt", **body}, timeout=60)


# --- echo + logprobs: the legacy shape ------------------------------------------------------------------------

def test_echo_with_logprobs_returns_every_prompt_token_then_every_generated_one(client, engine):
    ids = engine.tokenizer.encode(PROMPT).ids
    echoed = client.completions.create(model="gpt", prompt=PROMPT, echo=True, logprobs=2, max_tokens=6, temperature=0)
    plain = client.completions.create(model="gpt", prompt=PROMPT, logprobs=2, max_tokens=6, temperature=0)
    choice, alone = echoed.choices[0], plain.choices[0]
    lp = choice.logprobs
    assert choice.text == PROMPT + alone.text and choice.finish_reason == "length"
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing comes before the first token
    assert "".join(lp.tokens) == choice.text  # byte-level tokens of ASCII text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    # the completion's entries are the unechoed request's, the prompt's those of the engine's prompt pass
    assert lp.tokens[len(ids):] == alone.logprobs.tokens
    assert lp.token_logprobs[len(ids):] == alone.logprobs.token_logprobs
    assert lp.top_logprobs[len(ids):] == alone.logprobs.top_logprobs
    assert lp.text_offset[len(ids):] == [len(PROMPT) + offset for offset in alone.logprobs.text_offset]
    reference = _reference(engine, ids, 2)
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx([t.logprob for t in reference.tokens], abs=TOLERANCE)
    for top, expected in zip(lp.top_logprobs[1 : len(ids)], reference.tokens):
        assert list(top) == [engine.tokenizer.decode([t]) for t, _ in expected.top]
        assert list(top.values()) == pytest.approx([v for _, v in expected.top], abs=TOLERANCE)


def test_echo_without_logprobs_and_logprobs_zero(client, engine):
    plain = client.completions.create(model="gpt", prompt=PROMPT, echo=True, max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].text.startswith(PROMPT)
    zero = client.completions.create(model="gpt", prompt=PROMPT, echo=True, logprobs=0, max_tokens=3, temperature=0)
    lp = zero.choices[0].logprobs
    assert lp.top_logprobs[0] is None and all(top == {} for top in lp.top_logprobs[1:])
    assert len(lp.token_logprobs) == len(engine.tokenizer.encode(PROMPT).ids) + 3


def test_text_offsets_point_into_the_echoed_text_of_a_prompt_with_multibyte_characters(server, engine):
    """A character of several bytes is several byte-level tokens (each `bytes:\\xNN`): each token's offset is where
    its text begins in the echoed text, the tokens of one character all at its start (as OpenAI's)."""
    prompt = "Ô Roméo, ROMEO!"
    ids = engine.tokenizer.encode(prompt).ids
    choice = _post(server, prompt=prompt, echo=True, logprobs=1, max_tokens=0).json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text == prompt and len(ids) > len(prompt) and len(lp["text_offset"]) == len(ids)
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and set(offsets) == set(range(len(text)))  # every character starts a token
    for token, offset in zip(lp["tokens"], offsets):
        assert text[offset] == token or (token.startswith("bytes:") and ord(text[offset]) > 127)
    assert sum(token.startswith("bytes:") for token in lp["tokens"]) == 4  # Ô and é, two bytes each


# --- max_tokens 0: score only ---------------------------------------------------------------------------------

def test_max_tokens_zero_with_echo_scores_the_prompt_and_generates_nothing(client, engine):
    ids = engine.tokenizer.encode(PROMPT + CONTINUATION).ids
    scored = client.completions.create(model="gpt", prompt=PROMPT + CONTINUATION, echo=True, logprobs=1,
                                       max_tokens=0, temperature=0)
    choice = scored.choices[0]
    assert choice.text == PROMPT + CONTINUATION and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([t.logprob for t in _reference(engine, ids, 1).tokens],
                                                  abs=TOLERANCE)
    echoed = client.completions.create(model="gpt", prompt=PROMPT + CONTINUATION, echo=True, max_tokens=0)
    assert echoed.choices[0].text == PROMPT + CONTINUATION and echoed.choices[0].logprobs is None


def test_a_prompt_that_fills_the_context_can_be_scored(client, engine):
    prompt = ("ROMEO:\n" * 20)[: engine.context_length]
    scored = client.completions.create(model="gpt", prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    assert len(scored.choices[0].logprobs.tokens) == engine.context_length


def test_max_tokens_zero_without_echo_is_a_400_naming_max_tokens(client, server):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="gpt", prompt=PROMPT, max_tokens=0)
    assert refused.value.body["param"] == "max_tokens" and "echo" in refused.value.body["message"]
    assert _post(server, prompt=PROMPT, max_tokens=-1, echo=True).status_code == 400


# --- vLLM's prompt_logprobs -----------------------------------------------------------------------------------

def test_vllm_prompt_logprobs_give_each_prompt_token_its_logprob_rank_and_alternatives(server, engine):
    ids = engine.tokenizer.encode(PROMPT).ids
    response = _post(server, prompt=PROMPT, prompt_logprobs=3, max_tokens=2, temperature=0)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["logprobs"] is None and not choice["text"].startswith(PROMPT)  # neither echo nor logprobs
    entries = choice["prompt_logprobs"]
    reference = _reference(engine, ids, 3)
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry, expected, rank in zip(ids[1:], entries[1:], reference.tokens, reference.ranks):
        own = entry[str(token)]  # the prompt's own token, whatever its rank, then the top 3
        assert own["rank"] == rank and own["decoded_token"] == engine.tokenizer.decode([token])
        assert own["logprob"] == pytest.approx(expected.logprob, abs=TOLERANCE)
        assert list(entry) == [str(token)] + [str(t) for t, _ in expected.top if t != token]
        for i, (t, value) in enumerate(expected.top):
            assert entry[str(t)]["logprob"] == pytest.approx(value, abs=TOLERANCE)
            assert t == token or entry[str(t)]["rank"] == i + 1
    # echoed beside it: the legacy entries hold the same numbers
    both = _post(server, prompt=PROMPT, prompt_logprobs=1, echo=True, logprobs=1, max_tokens=0).json()["choices"][0]
    assert both["logprobs"]["token_logprobs"][1:] == [e[str(t)]["logprob"]
                                                      for t, e in zip(ids[1:], both["prompt_logprobs"][1:])]


def test_prompt_logprobs_out_of_range_is_a_400(server):
    response = _post(server, prompt=PROMPT, prompt_logprobs=21)
    assert response.status_code == 400 and "prompt_logprobs" in response.text


# --- what lm-eval sends and reads -----------------------------------------------------------------------------

def test_lm_eval_loglikelihood_requests_parse_to_the_continuation_s_log_likelihood(server, engine):
    """lm-eval 0.4's `local-completions` loglikelihood: token-id prompts (context + continuation), echo, logprobs
    1, max_tokens 1, temperature 0; `parse_logprobs` sums `token_logprobs[ctxlen:-1]` and checks that each token
    is the most likely (`is_greedy`)."""
    completions = pytest.importorskip("lm_eval.models.openai_completions")
    context, continuation = engine.tokenizer.encode(PROMPT).ids, engine.tokenizer.encode(CONTINUATION).ids
    greedy_context = engine.tokenizer.encode("ROMEO:\n").ids
    last, _ = engine.prefill([greedy_context])
    greedy_tail = [int(last[0].argmax())]  # the model's most likely next token: a greedy continuation
    requests = [(context, continuation), (greedy_context, greedy_tail)]
    body = {"model": "gpt", "prompt": [c + t for c, t in requests], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    parsed = completions.LocalCompletionsAPI.parse_logprobs(response.json(), ctxlens=[len(c) for c, _ in requests])
    for (ctx, cont), (loglikelihood, is_greedy) in zip(requests, parsed):
        reference = _reference(engine, ctx + cont, 1)
        expected = [t.logprob for t in reference.tokens[len(ctx) - 1 :]]
        assert loglikelihood == pytest.approx(sum(expected), abs=len(expected) * TOLERANCE)
        assert is_greedy == all(rank == 1 for rank in reference.ranks[len(ctx) - 1 :])
    assert [greedy for _, greedy in parsed] == [False, True]


def test_token_id_prompts_score_as_their_text(server, engine):
    ids = engine.tokenizer.encode(PROMPT).ids
    by_text = _post(server, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0).json()["choices"][0]
    by_ids = _post(server, prompt=ids, echo=True, logprobs=1, max_tokens=0).json()["choices"][0]
    assert by_ids["text"] == by_text["text"] == PROMPT
    assert by_ids["logprobs"] == by_text["logprobs"]


# --- n, best_of, streams --------------------------------------------------------------------------------------

def test_every_choice_carries_the_same_prompt_entries(client, engine):
    """n > 1 and best_of with echo + logprobs: the prompt is scored once; each choice has its entries in front of
    its own completion's. With max_tokens 0 every choice is the prompt alone."""
    prompt_tokens = len(engine.tokenizer.encode(PROMPT).ids)
    sampled = client.completions.create(model="gpt", prompt=PROMPT, echo=True, logprobs=1, max_tokens=8,
                                        temperature=1.0, n=3, best_of=4, seed=5)
    choices = sampled.choices
    assert len(choices) == 3 and len({c.text for c in choices}) > 1
    for c in choices:
        assert c.logprobs.token_logprobs[:prompt_tokens] == choices[0].logprobs.token_logprobs[:prompt_tokens]
        assert len(c.logprobs.tokens) == prompt_tokens + len(c.logprobs.tokens[prompt_tokens:])
        assert c.text.startswith(PROMPT) and "".join(c.logprobs.tokens) == c.text
    scored = client.completions.create(model="gpt", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0, n=2)
    assert [c.index for c in scored.choices] == [0, 1]
    assert scored.choices[0].logprobs == scored.choices[1].logprobs and scored.usage.completion_tokens == 0


def test_a_stream_echoes_but_does_not_carry_the_prompt_s_log_probabilities(client, server):
    chunks = list(client.completions.create(model="gpt", prompt=PROMPT, echo=True, max_tokens=6, temperature=0,
                                            stream=True))
    unstreamed = client.completions.create(model="gpt", prompt=PROMPT, echo=True, max_tokens=6, temperature=0)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == unstreamed.choices[0].text
    only_prompt = list(client.completions.create(model="gpt", prompt=PROMPT, echo=True, max_tokens=0, stream=True))
    assert "".join(c.choices[0].text for c in only_prompt if c.choices) == PROMPT
    assert only_prompt[-1].choices[0].finish_reason == "length"
    for body, field in (({"echo": True, "logprobs": 1}, "stream"), ({"prompt_logprobs": 1}, "prompt_logprobs")):
        response = _post(server, prompt=PROMPT, max_tokens=2, stream=True, **body)
        assert response.status_code == 400 and response.json()["error"]["param"] == field


# --- the numbers do not depend on the batch -------------------------------------------------------------------

def _other(server, i: int) -> httpx.Response:
    """Requests of other lengths and modes, some scoring their prompts too, sent beside the target."""
    prompt = ["O", "KING RICHARD III:\nNow is the winter", "To be, or not", "MENENIUS:\nWhy, masters"][i % 4]
    body = [{"max_tokens": 20, "temperature": 0}, {"max_tokens": 12, "temperature": 0.8, "seed": i},
            {"echo": True, "logprobs": 2, "max_tokens": 0}, {"echo": True, "logprobs": 1, "max_tokens": 4}][i % 4]
    return _post(server, prompt=prompt, **body)


def test_the_prompt_s_log_probabilities_are_the_same_alone_and_among_other_requests(server):
    target = {"prompt": PROMPT + CONTINUATION, "echo": True, "logprobs": 3, "max_tokens": 5, "temperature": 0}
    alone = _post(server, **target).json()["choices"][0]["logprobs"]
    with ThreadPoolExecutor(OTHERS + 1) as pool:
        others = [pool.submit(_other, server, i) for i in range(OTHERS)]
        among = pool.submit(_post, server, **target)
        assert all(o.result().status_code == 200 for o in others)
        batched = among.result().json()["choices"][0]["logprobs"]
    assert batched["tokens"] == alone["tokens"] and batched["text_offset"] == alone["text_offset"]
    assert batched["token_logprobs"][0] is None
    assert batched["token_logprobs"][1:] == pytest.approx(alone["token_logprobs"][1:], abs=TOLERANCE)
    for top, expected in zip(batched["top_logprobs"][1:], alone["top_logprobs"][1:]):
        assert list(top) == list(expected) and list(top.values()) == pytest.approx(list(expected.values()),
                                                                                   abs=TOLERANCE)
