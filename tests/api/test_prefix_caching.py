"""Automatic prefix caching over HTTP, on the tiny GPT (a context of 64 tokens): a prompt seen before is answered
from its cached blocks (`usage.prompt_tokens_details.cached_tokens`, streamed usage too, counted once per prompt
whatever `n` is) with exactly the output of a miss and of a server without the cache (text, every token's
log-probability, the prompt's log-probabilities of `echo`); the metrics count the tokens looked up and found and
the bytes held; `/v1/models` says whether the cache is on and, when off, why.
"""

from __future__ import annotations

import json

import pytest

from service.engines.prefix_cache import BLOCK_TOKENS, usable_tokens
from service.settings import Settings
from tests.support.metrics import metric, scrape

pytestmark = pytest.mark.slow

# ~50 byte-level tokens: whole blocks that a repeat can hit, within the tiny GPT's 64-token context
PROMPT = "ROMEO:\nBut soft, what light through yonder window"
OTHER = "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo"
LABELS = {"model": "gpt", "version": "1"}


def _complete(client, prompt: str, **extra) -> dict:
    body = {"model": "gpt", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2, **extra}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _output(body: dict) -> list:
    return [(c["text"], c["logprobs"]) for c in body["choices"]]


@pytest.fixture(scope="module")
def reference(tiny_repository, serving) -> dict:
    """Every request's output from a server without the cache, and what its /v1/models says."""
    with serving(Settings(repository=tiny_repository, models=["gpt"], prefix_cache=False)) as client:
        models = client.get("/v1/models").json()["data"]
        return {"greedy": _output(_complete(client, PROMPT)),
                "echo": _output(_complete(client, PROMPT, echo=True, max_tokens=0)),
                "sampled": _output(_complete(client, OTHER, temperature=1.0, seed=5, n=2)),
                "usage": _complete(client, PROMPT)["usage"], "model": next(m for m in models if m["id"] == "gpt")}


def test_a_repeated_prompt_is_answered_from_its_cached_blocks_with_the_output_of_a_miss(tiny_repository, serving,
                                                                                         reference):
    assert reference["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    off = reference["model"]["variant"]
    assert off["prefix_cache"] == "off" and off["prefix_caching"]["reason"] == "turned off (TSERVE_PREFIX_CACHE)"
    with serving(Settings(repository=tiny_repository, models=["gpt"], prefix_cache_mb=8)) as client:
        before = scrape(client)
        miss = _complete(client, PROMPT)
        hit = _complete(client, PROMPT)
        tokens = miss["usage"]["prompt_tokens"]
        cached = usable_tokens(tokens)
        assert cached >= BLOCK_TOKENS, "the prompt is meant to span whole blocks"
        after = scrape(client)
        assert miss["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert hit["usage"]["prompt_tokens_details"] == {"cached_tokens": cached}
        assert hit["usage"]["prompt_tokens"] == tokens
        assert _output(miss) == _output(hit) == reference["greedy"]
        delta = {name: metric(after, name, **LABELS) - metric(before, name, **LABELS)
                 for name in ("tserve_prefix_cache_queries_total", "tserve_prefix_cache_hits_total")}
        assert delta == {"tserve_prefix_cache_queries_total": 2 * tokens, "tserve_prefix_cache_hits_total": cached}
        assert 0 < metric(after, "tserve_prefix_cache_bytes", **LABELS) <= 8 << 20
        # the prompt's log-probabilities (lm-eval's echo) from the cached blocks: the same numbers
        assert _output(_complete(client, PROMPT, echo=True, max_tokens=0)) == reference["echo"]
        # n choices of one prompt: its cached tokens once; seeded samples unchanged by the hit
        other_tokens = _complete(client, OTHER, max_tokens=1)["usage"]["prompt_tokens"]
        sampled = _complete(client, OTHER, temperature=1.0, seed=5, n=2)
        assert sampled["usage"]["prompt_tokens_details"] == {"cached_tokens": usable_tokens(other_tokens)}
        assert _output(sampled) == reference["sampled"]
        model = next(m for m in client.get("/v1/models").json()["data"] if m["id"] == "gpt")
        assert model["variant"]["prefix_cache"] == "on" and model["variant"]["speculation"] == "off"
        assert model["variant"]["prefix_caching"] == {"enabled": "true", "block_tokens": str(BLOCK_TOKENS),
                                                      "budget_bytes": str(8 << 20)}


def test_a_streams_usage_counts_the_cached_tokens(tiny_repository, serving):
    with serving(Settings(repository=tiny_repository, models=["gpt"])) as client:
        _complete(client, PROMPT)
        body = {"model": "gpt", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            chunks = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                      if line.startswith("data: {")]
        usage = chunks[-1]["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": usable_tokens(usage["prompt_tokens"])}
