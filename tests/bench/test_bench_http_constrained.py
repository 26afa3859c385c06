"""bench/bench_http.py's constrained case without a server: its schema (valid, compiled by llguidance, every
document it admits within the default 64 new tokens), the new schema each request gets (all distinct, never the
cached one), the request bodies, the sample's check (a fake response), the ratio lines and their math, and the
--cases entry."""

from __future__ import annotations

import json
import sys
import types

import httpx
import jsonschema
import llguidance
import pytest

from tests.support import ROOT

BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import bench_http  # noqa: E402 - after the sys.path set-up, as the script's own
from httpbench import constrained  # noqa: E402

DEFAULT_NEW_TOKENS = 64  # bench_http's --max-new-tokens default; the byte-level GPT writes a byte per token


def test_the_schema_is_valid_and_bounded():
    schema = constrained.schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert len(schema["properties"]) == 8 and schema["required"] == list(schema["properties"])
    longest = constrained.longest_document(schema)
    jsonschema.validate(longest, schema)
    assert len(constrained.compact(longest)) == 62 <= DEFAULT_NEW_TOKENS
    for key, node in schema["properties"].items():  # no value longer than the longest's admitted
        if "enum" in node:
            assert all(len(json.dumps(v)) <= len(json.dumps(longest[key])) for v in node["enum"])
    with pytest.raises(jsonschema.ValidationError):  # the string's bytes are bounded: lowercase letters only
        jsonschema.validate(longest | {"q": "\u00e9"}, schema)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""


def test_every_request_gets_a_new_schema_never_the_cached_one():
    names = [constrained.fresh_name(i) for i in range(constrained.FRESH_SCHEMAS)]
    assert names[:3] == ["AAA", "AAB", "AAC"] and names[-1] == "ZZZ"
    assert len(set(names)) == constrained.FRESH_SCHEMAS and constrained.CACHED_NAME not in names
    bodies = constrained.FreshSchemaBodies(["ROMEO:", "JULIET:"], 64)
    first = [json.loads(bodies[i]) for i in range(4)]
    assert [b["prompt"] for b in first] == ["ROMEO:", "JULIET:", "ROMEO:", "JULIET:"]
    assert all(b["max_new_tokens"] == 64 and b["temperature"] == 0 and b["stream"] for b in first)
    schemas = [json.dumps(b["json_schema"], sort_keys=True) for b in first]
    assert len(set(schemas)) == 4 and json.dumps(constrained.schema(), sort_keys=True) not in schemas
    for b in first:  # each differs in one enum value only: the same bound on its documents
        jsonschema.Draft202012Validator.check_schema(b["json_schema"])
        assert b["json_schema"]["properties"]["w"]["enum"][:2] == ["rom", "nur"]
    assert len(bodies) == constrained.FRESH_SCHEMAS
    with pytest.raises(IndexError):
        bodies[constrained.FRESH_SCHEMAS]


def test_the_cached_workload_is_the_gpt_cases_with_one_schema():
    workload = constrained.constrained_workload(["ROMEO:", "JULIET:"], 64)
    assert workload.path == "/v1/generate" and workload.stream and workload.unit == "tokens/s"
    bodies = [json.loads(b) for b in workload.bodies]
    assert [b["prompt"] for b in bodies] == ["ROMEO:", "JULIET:"]
    assert all(b["json_schema"] == constrained.schema() and b["max_new_tokens"] == 64 for b in bodies)
    assert isinstance(constrained.constrained_workload(["ROMEO:"], 64, fresh=True).bodies,
                      constrained.FreshSchemaBodies)


def test_the_sample_is_validated_and_a_refusal_skips_the_case(monkeypatch):
    server = types.SimpleNamespace(url="http://service")
    sent = []

    def answer(text: str, status: int = 200):
        def post(url, content, **_):
            sent.append((url, json.loads(content)))
            return httpx.Response(status, json={"text": text, "finish_reason": "stop",
                                                "usage": {"completion_tokens": len(text)}},
                                  request=httpx.Request("POST", url))
        monkeypatch.setattr(httpx, "post", post)

    document = constrained.compact(constrained.longest_document(constrained.schema()))
    answer(document)
    assert constrained.sample(server, "ROMEO:", 64) == {"text": document, "tokens": 62, "finish_reason": "stop",
                                                        "valid": True}
    assert sent[0][0] == "http://service/v1/generate" and sent[0][1]["stream"] is False
    answer(document.replace('"rom"', '"tybalt"'))
    assert constrained.sample(server, "ROMEO:", 64)["valid"] is False
    answer('{"a":1')
    assert constrained.sample(server, "ROMEO:", 64)["valid"] is False
    answer("", status=422)
    with pytest.raises(RuntimeError, match="the constrained sample request failed"):
        constrained.sample(server, "ROMEO:", 64)


def summary(case: str, throughput: float, ttft_p50: float | None, tokens: float, errors: int = 0) -> dict:
    return {"case": case, "throughput": throughput, "ttft_ms": {"p50": ttft_p50}, "work_per_request": tokens,
            "errors": errors}


def test_the_ratio_lines_and_their_math(capsys):
    cases = [summary("gpt c=1", 1000.0, 10.0, 64), summary("gpt c=32", 3000.0, 50.0, 64),
             summary("gpt json c=1", 800.0, 12.0, 40), summary("gpt json c=32", 2400.0, 60.0, 40, errors=1),
             summary("gpt json-new c=1", 600.0, 30.0, 40)]
    rows = constrained.evaluate_constrained(cases, constrained.constrained_ratios([1, 32]), {})
    assert [(r["ratio"], r["value"]) for r in rows] == [
        ("constrained/unconstrained 1 streams tokens/s", 0.8), ("constrained/unconstrained 32 streams tokens/s", 0.8),
        ("new schema/unconstrained 1 stream TTFT p50", 3.0), ("cached schema/unconstrained 1 stream TTFT p50", 1.2),
        ("new schema/cached schema 1 stream TTFT p50", 2.5)]
    assert rows[0]["tokens_per_request"] == [40, 64] and rows[1]["errors_in_cases"] == 1
    assert json.loads(json.dumps(rows)) == rows  # as the JSON report holds them
    constrained.print_constrained(rows)
    out = capsys.readouterr().out
    assert "constrained/unconstrained 1 streams tokens/s = 0.80   (800.0 vs 1,000.0 tokens/s; tokens per request " \
           "40.0 vs 64.0)" in out
    assert "constrained/unconstrained 32 streams tokens/s = 0.80  [errors in these cases: 1]" in out
    assert "new schema/unconstrained 1 stream TTFT p50 = 3.00   (30.0 vs 10.0 ms)" in out


def test_a_missing_case_names_its_cases_entry():
    rows = constrained.evaluate_constrained([summary("gpt json c=1", 800.0, 12.0, 40)],
                                            constrained.constrained_ratios([1]), {"gpt": "no gpt model in repo"})
    assert rows[0]["value"] is None and rows[0]["reason"] == "no gpt model in repo"
    assert "--cases without constrained" in rows[1]["reason"]  # the new-schema case did not run
    rows = constrained.evaluate_constrained([summary("gpt c=1", 1.0, None, 64), summary("gpt json c=1", 1.0, 12.0, 40)],
                                            constrained.constrained_ratios([1]), {})
    assert rows[2]["reason"] == "no ttft_p50 in gpt c=1"


def test_constrained_is_a_case_of_the_command_line():
    assert "constrained" in bench_http.parse_args(["--quick"]).cases
    assert bench_http.parse_args(["--cases", "gpt,constrained"]).cases == ["gpt", "constrained"]
    assert "constrained" in bench_http.SERVICE_CASES
    names = [constrained.case_name(c) for c in (1, 32)] + [constrained.case_name(1, fresh=True)]
    assert names == ["gpt json c=1", "gpt json c=32", "gpt json-new c=1"]
    assert all(len(name) <= 18 for name in names)  # the tables' case column
