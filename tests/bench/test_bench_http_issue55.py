"""bench/bench_http.py's issue-55 cases (prefix, lm-eval, speculation) and bench_engine's prefix task without a
server: the prompts they cut (no two share a cached block; the hit's exactly the prefix's whole blocks), the
lm-eval replay against the installed lm-eval's own request code (order, encoding, body), prompt lookup's rate and
the copy-heavy prompts it picks, the speculation servers' variant, the counters read from /metrics, a stream's
tokens counted from its usage, the ratio lines with their goals, and the --cases entries."""

from __future__ import annotations

import asyncio
import json
import random
import string
import sys
import types

import httpx
import pytest

from tests.support import ROOT

BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_http  # noqa: E402 - after the sys.path set-up, as the script's own
from enginebench import prefix as engine_prefix  # noqa: E402
from enginebench.workloads import FIRST_REGULAR_ID, GptSpec  # noqa: E402
from httpbench import ab, lmeval, load, prefix, speculation  # noqa: E402

BLOCK = 16
TEXT = "".join(f"{i:05d} SPEAKER:\n{i * 7919 % 100000:05d} line of the play, with words to fill it out well\n\n"
               for i in range(3000))  # lines that begin alike only where they should not be used


def test_block_starts_are_non_empty_lines_whose_first_block_is_new():
    text = "ROMEO:\nAy me.\n\nROMEO:\nAy me again, and more.\n\nJULIET:\nO Romeo, Romeo!\n"
    starts = ab.block_starts(text, 6, 1)
    assert [text[s : s + 6] for s in starts] == ["ROMEO:", "Ay me.", "Ay me ", "JULIET", "O Rome"]
    assert ab.block_starts(text, 6, len(text)) == [0]  # at least min_chars after each
    assert ab.split_starts(list(range(7)), 3) == [[0, 3, 6], [1, 4], [2, 5]]


def test_the_ttft_prompts_share_the_prefix_and_nothing_else():
    starts = ab.block_starts(TEXT, BLOCK, 256)
    shared, fresh = prefix.ttft_prompts(TEXT, starts, count=64)
    assert len(shared) == len(fresh) == 64
    assert {len(p) for p in shared + fresh} == {prefix.PREFIX_CHARS + prefix.SUFFIX_CHARS}
    assert len({p[: prefix.PREFIX_CHARS] for p in shared}) == 1
    assert [p[prefix.PREFIX_CHARS :] for p in shared] == [p[prefix.PREFIX_CHARS :] for p in fresh]
    # a hit covers the prefix's 12 whole blocks: the 13th (8 prefix tokens, 8 suffix tokens) differs in every prompt
    thirteenth = [p[12 * BLOCK : 13 * BLOCK] for p in shared]
    assert len(set(thirteenth)) == len(shared)
    firsts = [p[:BLOCK] for p in fresh] + [shared[0][:BLOCK]]
    assert len(set(firsts)) == len(firsts)  # a fresh prefix is never found
    with pytest.raises(ValueError, match="needs 64"):
        prefix.ttft_prompts(TEXT, starts[:64], count=64)


def test_the_no_prefix_prompts_share_no_block_and_requests_are_pinned():
    starts = ab.block_starts(TEXT, BLOCK, 256)
    prompts = prefix.no_prefix_prompts(TEXT, starts, count=100)
    assert len({p[:BLOCK] for p in prompts}) == 100 and {len(p) for p in prompts} == {prefix.NO_PREFIX_CHARS}
    body = json.loads(prefix.generate_body("ROMEO:", 8))
    assert body == {"prompt": "ROMEO:", "max_new_tokens": 8, "min_new_tokens": 8, "temperature": 0, "stream": True}
    workload = prefix.workload(["a", "b"], 8, usage_tokens=True)
    assert workload.path == "/v1/generate" and workload.stream and workload.usage_tokens


def test_word_order_documents_have_the_fixtures_shape():
    starts = ab.block_starts(TEXT, BLOCK, 256)
    docs = lmeval.word_order_docs(TEXT, starts, 40)
    assert len(docs) == 40 and docs == lmeval.word_order_docs(TEXT, starts, 40)  # deterministic
    ends = []
    for doc in docs:
        low, high = lmeval.CONTEXT_CHARS
        assert low <= len(doc["context"]) <= high and not doc["context"].endswith(" ")
        assert len(doc["choices"]) == len(set(doc["choices"])) == 4
        assert all(sorted(c.split()) == sorted(doc["choices"][0].split()) for c in doc["choices"])
        line_end = TEXT.index("\n", TEXT.index(doc["context"]) + len(doc["context"]))
        assert TEXT[: line_end].endswith(doc["context"] + " " + doc["choices"][doc["label"]])  # the line's own order
        ends.append((TEXT.index(doc["context"]), line_end))
    assert all(end <= next_start for (_, end), (next_start, _) in zip(ends, ends[1:]))  # no two overlap


def test_the_replay_is_what_lm_eval_sends():
    pytest.importorskip("lm_eval")
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.models.utils import Collator

    def encode(text: str) -> list[int]:  # a byte-level tokenizer, like the GPT's
        return list(text.encode())

    docs = lmeval.word_order_docs(TEXT, ab.block_starts(TEXT, BLOCK, 256), 12)
    docs[0]["context"] += " "  # a trailing space moves into the continuation, as `_encode_pair` moves it
    ours = lmeval.loglikelihood_prompts(docs, encode, 256)
    model = types.SimpleNamespace(backend="causal", tok_encode=encode)
    requests = [(None, *TemplateLM._encode_pair(model, doc["context"], " " + choice))
                for doc in docs for choice in doc["choices"]]
    collator = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])), group_by=None)
    theirs = [context + continuation for (_, context, continuation), in collator.get_batched(n=1)]
    assert ours == theirs and len(ours) == 4 * len(docs)
    first = [lmeval.word_order_docs(TEXT, ab.block_starts(TEXT, BLOCK, 256), 12)[0]]
    order = lmeval.loglikelihood_prompts(first, encode, 256)
    assert len({tuple(p[: len(first[0]["context"])]) for p in order}) == 1  # a document's choices together
    api = types.SimpleNamespace(model="gpt")
    assert lmeval.payload("gpt", ours[0]) == LocalCompletionsAPI._create_payload(api, [ours[0]], generate=False)
    assert lmeval.loglikelihood_prompts(first, encode, 10)[0] == order[0][-10:]  # cut from the left, as lm-eval


def test_a_scored_choice_needs_its_prompt_log_probabilities():
    assert lmeval.scored({"choices": [{"logprobs": {"token_logprobs": [None, -1.5]}}]}) == 1.0
    for bad in ({"choices": [{"logprobs": {"token_logprobs": []}}]}, {"choices": [{"logprobs": None}]}):
        with pytest.raises((ValueError, TypeError)):
            lmeval.scored(bad)
    workload = lmeval.lm_eval_workload("gpt", [[{"context": "ab", "choices": ["c d", "d c"], "label": 0}]],
                                       lambda s: list(s.encode()), 256)
    assert [json.loads(b)["prompt"] for b in workload.bodies] == [[list(b"ab c d")], [list(b"ab d c")]]
    assert workload.path == "/v1/completions" and not workload.stream


def test_prompt_lookup_rate():
    assert speculation.lookup_rate("abcdabcd", "abcdab", min_n=2) == 1.0
    assert speculation.lookup_rate("abcdefgh", "xyz", min_n=2) == 0.0
    assert speculation.lookup_rate("abcab", "c", min_n=2) == 1.0  # "ab" occurred before, then "c"
    assert speculation.lookup_rate("abcab", "c", min_n=3) == 0.0  # no 3-gram ending "ab" occurred before
    assert speculation.lookup_rate("xabcyabcz", "y", min_n=3) == 0.0  # the latest occurrence wins: "abc" -> "z"
    assert speculation.lookup_rate("ab", "") == 0.0
    loop = "I will be so.\n\n" * 3
    assert speculation.lookup_rate(loop, loop) == 1.0


def test_copy_prompts_keep_the_candidates_whose_continuation_repeats_itself():
    loop = "GRUMIO:\nI will be so.\n\n" * 10
    varied = "".join(random.Random(0).choices(string.ascii_letters, k=200))  # no 4-gram comes back
    kept = speculation.copy_prompts(["A:", "B:", "C:"], [loop, varied, None], prefix=96, new_tokens=96)
    assert [(copy, round(rate, 2)) for copy, rate in kept] == [("A:" + loop[:96], 1.0)]
    assert speculation.copy_prompts(["A:"], [loop[:100]], prefix=96, new_tokens=96) == []  # too short


@pytest.mark.parametrize("pins,override,expected", [
    ("gpt=int8+gqa+kv8,translation=int8", None, "gpt=int8+gqa"),
    ("int8+gqa+kv8", None, "gpt=int8+gqa"),
    ("gpt=fp32+gqa+kv8", None, "gpt=fp32+gqa"),
    ("gpt=int8+gqa,translation=int8", None, None),
    (None, None, None),
    ("gpt=int8+gqa+kv8", "int8+gqa+kv8", "gpt=int8+gqa+kv8"),
])
def test_the_speculation_servers_run_a_float_kv_cache_unless_told(pins, override, expected):
    variant, why = speculation.speculation_variant(pins, "gpt", override)
    assert variant == expected and why


def test_counters_are_summed_over_labels(monkeypatch):
    text = ("# HELP tserve_prefix_cache_hits Prompt tokens found.\n# TYPE tserve_prefix_cache_hits counter\n"
            'tserve_prefix_cache_hits_total{model="gpt",version="1"} 192.0\n'
            'tserve_prefix_cache_hits_total{model="gpt",version="2"} 8.0\n'
            'tserve_prefix_cache_hits_created{model="gpt",version="1"} 1.7e9\n'
            'tserve_prefix_cache_queries_total{model="gpt",version="1"} 432.0\n')
    monkeypatch.setattr(httpx, "get", lambda url, **_: httpx.Response(200, text=text))
    from httpbench.servers import metric_totals

    assert metric_totals("http://s", ab.PREFIX_COUNTERS + ab.SPEC_COUNTERS) == {
        "tserve_prefix_cache_queries": 432.0, "tserve_prefix_cache_hits": 200.0,
        "tserve_spec_decode_num_draft_tokens": 0.0, "tserve_spec_decode_num_accepted_tokens": 0.0}
    assert ab.cached_share({"counters": {"tserve_prefix_cache_queries": 432.0, "tserve_prefix_cache_hits": 192.0}}) \
        == pytest.approx(192 / 432)
    assert ab.cached_share({"counters": {}}) is None
    assert ab.acceptance({"counters": {"tserve_spec_decode_num_draft_tokens": 10.0,
                                       "tserve_spec_decode_num_accepted_tokens": 9.0}}) == (10.0, 0.9)
    assert ab.acceptance(None) == (0.0, None)


def _stream(events: list[dict]) -> bytes:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"


@pytest.mark.parametrize("usage_tokens,work,note", [(True, 5.0, None), (False, 3.0, "usage says 5 tokens, 3 token events")])
def test_a_stream_of_several_tokens_an_event_counts_its_usage(usage_tokens, work, note):
    events = [{"token": " be ", "index": 0}, {"token": "so.\n", "index": 1}, {"token": "\n", "index": 2},
              {"token": "", "index": 3, "finish_reason": "length", "usage": {"completion_tokens": 5}}]
    workload = load.Workload("/v1/generate", [b"{}"], {}, stream=True, usage_tokens=usage_tokens)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=_stream(events)))

    async def send():
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
            return await load.send_stream(client, workload, b"{}")

    result = asyncio.run(send())
    assert result.error is None and result.work == work and result.note == note and result.ttft is not None
    events[-1].pop("usage")
    result = asyncio.run(send())
    assert (result.error == "stream without usage") == usage_tokens


def summary(case: str, throughput: float, ttft_p50: float | None, ok: int = 10, wall: float = 2.0,
            errors: int = 0, counters: dict | None = None) -> dict:
    return {"case": case, "throughput": throughput, "ttft_ms": {"p50": ttft_p50}, "ok": ok, "wall_s": wall,
            "errors": errors, "unit": "tokens/s", "counters": counters or {}}


def test_the_ratio_lines_their_goals_and_notes(capsys):
    hits = {"tserve_prefix_cache_queries": 2160.0, "tserve_prefix_cache_hits": 1920.0}
    cases = [summary(prefix.HIT, 400.0, 10.0, counters=hits), summary(prefix.MISS, 200.0, 40.0),
             summary(prefix.HIT_OFF, 200.0, 38.0), summary(prefix.NO_PREFIX_ON, 1650.0, 500.0, errors=1),
             summary(prefix.NO_PREFIX_OFF, 1700.0, 500.0),
             summary(lmeval.ON_CASE, 50.0, None, ok=100, wall=2.0), summary(lmeval.OFF_CASE, 28.0, None, ok=56)]
    rows = prefix.annotate(ab.evaluate(cases, prefix.prefix_ratios(), {}), cases)
    assert [(r["value"], r["status"]) for r in rows] == [(0.25, "PASS"), (10 / 38, None), (1650 / 1700, "MISS")]
    assert rows[2]["errors_in_cases"] == 1  # 0.97 meets the goal, the error voids its PASS
    lm = ab.evaluate(cases, lmeval.lm_eval_ratios(), {})[0]
    assert lm["value"] == pytest.approx(20.0 / (2000 / 56)) and lm["unit"] == "ms" and lm["status"] == "PASS"
    assert json.loads(json.dumps(rows)) == rows  # as the JSON report holds them
    ab.print_ratios("Prefix caching (issue 55)", "AMD EPYC (2 cores; ISA: avx2)", rows)
    out = capsys.readouterr().out
    assert "Prefix caching (issue 55), measured in this run on AMD EPYC (2 cores; ISA: avx2):" in out
    assert ("prefix hit/miss 1 stream TTFT p50 = 0.25   (goal <= 0.3: PASS; 10.0 vs 40.0 ms; prompt tokens cached "
            "89% vs n/a)") in out
    assert "no shared prefix cache on/off 32 streams tokens/s = 0.97  [errors in these cases: 1]   (goal >= 0.97: MISS" \
        in out


def test_a_missing_case_says_why_and_speculation_notes_its_drafts():
    rows = ab.evaluate([summary(speculation.case_name("copy", True, 1), 1500.0, 5.0)],
                       speculation.speculation_ratios(), {"speculation": "no copy-heavy prompt found"})
    assert rows[0]["value"] is None and rows[0]["reason"] == "no copy-heavy prompt found"
    assert "--cases without speculation" in ab.evaluate([], speculation.speculation_ratios(), {})[1]["reason"]
    drafts = {"tserve_spec_decode_num_draft_tokens": 100.0, "tserve_spec_decode_num_accepted_tokens": 90.0}
    cases = [summary(speculation.case_name("copy", True, 1), 1500.0, 5.0, counters=drafts),
             summary(speculation.case_name("copy", False, 1), 1000.0, 5.0),
             summary(speculation.case_name("open", True, 32), 1000.0, 5.0),
             summary(speculation.case_name("open", False, 32), 1000.0, 5.0)]
    rows = speculation.annotate(ab.evaluate(cases, speculation.speculation_ratios(), {}), cases)
    assert rows[0]["notes"] == ["100 draft tokens, 90% accepted"] and rows[0]["status"] == "PASS"
    assert rows[2]["notes"] == ["the on server drafted nothing"] and rows[2]["status"] == "PASS"
    assert ab.judge(0.3, ("<=", 0.3), 0) == "PASS" and ab.judge(1.49, (">=", 1.5), 0) == "MISS"


def test_the_cases_are_on_the_command_line_and_fit_the_tables():
    args = bench_http.parse_args(["--quick"])
    assert {"prefix", "lm-eval", "speculation"} <= set(args.cases) and args.speculation_variant is None
    args = bench_http.parse_args(["--cases", "prefix,lm-eval,speculation", "--speculation-variant", "fp32"])
    assert args.cases == ["prefix", "lm-eval", "speculation"] and args.speculation_variant == "fp32"
    names = [prefix.HIT, prefix.MISS, prefix.HIT_OFF, prefix.NO_PREFIX_ON, prefix.NO_PREFIX_OFF, lmeval.ON_CASE,
             lmeval.OFF_CASE] + [speculation.case_name(k, on, c) for k, c in (("copy", 1), ("open", 1), ("open", 32))
                                 for on in (True, False)]
    assert len(set(names)) == len(names) and all(len(name) <= 18 for name in names)  # the tables' case column
    assert set(prefix.SERVERS) .isdisjoint(speculation.SERVERS)


def test_the_engine_prefix_task_prompts():
    spec = GptSpec(vocab_size=257)
    own = engine_prefix.prefix_prompts(spec, 3, seed=1)
    assert len(own) == 3 and {len(p) for p in own} == {engine_prefix.PREFIX_TOKENS + engine_prefix.SUFFIX_TOKENS}
    shared = own[0][: engine_prefix.PREFIX_TOKENS]
    hits = engine_prefix.prefix_prompts(spec, 3, seed=2, shared=shared)
    assert all(p[: engine_prefix.PREFIX_TOKENS] == shared for p in hits)
    assert all(FIRST_REGULAR_ID <= t < spec.vocab_size for p in own + hits for t in p)
    assert engine_prefix.prefix_prompts(spec, 3, seed=1) == own  # seeded
