"""n-gram speculation as an operator turns it on (`TSERVE_SPECULATION=ngram`), on the tiny GPT (a float KV cache):
`/v1/models` says the GPT's steps speculate, a greedy request whose continuation its own text predicts is decoded
with drafts (the spec_decode counters move: drafts, draft tokens, accepted tokens no more than drafted), and a
server left as it is says `off`. What speculation computes is tests/unit/engines/test_speculation.py's."""

from __future__ import annotations

import pytest

from service.settings import Settings
from tests.support.metrics import metric, scrape

pytestmark = pytest.mark.slow

LABELS = {"model": "gpt", "version": "1"}
REPEATED = "the king the king the king the king the"


def _speculation(client) -> str:
    return next(m for m in client.get("/v1/models").json()["data"] if m["id"] == "gpt")["variant"]["speculation"]


def test_speculation_is_reported_and_counted_when_turned_on(tiny_repository, serving):
    with serving(Settings(repository=tiny_repository, models=["gpt"])) as client:
        assert _speculation(client) == "off"
    with serving(Settings(repository=tiny_repository, models=["gpt"], speculation="ngram")) as client:
        assert _speculation(client) == "ngram"
        response = client.post("/v1/generate", json={"prompt": REPEATED, "max_new_tokens": 12, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 12
        samples = scrape(client)
        drafts = metric(samples, "tserve_spec_decode_num_drafts_total", **LABELS)
        drafted = metric(samples, "tserve_spec_decode_num_draft_tokens_total", **LABELS)
        accepted = metric(samples, "tserve_spec_decode_num_accepted_tokens_total", **LABELS)
        assert drafts >= 1 and drafted >= drafts and 0 <= accepted <= drafted
