"""The constrained GPT case (issue 54): the gpt case's prompts and streams (`POST /v1/generate`, greedy, the same
`max_new_tokens`), each request with a JSON schema (`json_schema`), and its ratios to the unconstrained gpt case.

- `gpt json c=N`: the same schema in every request (compiled by its first, then from the service's cache), at the gpt
  case's stream counts -> tokens/s per generated token (a constrained document ends before `max_new_tokens`, so
  the ratio is of tokens/s, not of requests/s);
- `gpt json-new c=1`: a schema never seen before in every request (one enum value differs: `fresh_name`), so each
  is compiled before its first token -> time to first token (a run's hundreds of new schemas push the cached one
  out of the service's cache of 256: the cached case's first request of a round may compile it again);
- the ratios, printed like the peers' (`constrained/unconstrained 32 streams tokens/s = 0.81`): tokens/s at each
  stream count, and the p50 TTFT at 1 stream of a new schema, of the cached one and of the new over the cached,
  each over the unconstrained (or cached) case's.

The schema: 8 properties, every one required and bounded (enums, integer ranges, a boolean, a string of at most 3
lowercase letters), so that even random weights must close the document: its longest compact document is 62 bytes
(`longest_document`), within the default 64 new tokens of the byte-level GPT (one token per byte). Ten properties
cannot fit: their keys, colons, commas and braces alone take 51 bytes. bench/constrained.py measures the same
costs offline (no HTTP) on the released GPT with a longer, 10-property schema.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from typing import NamedTuple

from service.client.launcher import ServiceProcess

from .cases import JSON_HEADERS, Case
from .load import Workload
from .report import NOT_MEASURED, case_metric, case_spread, peer_line, print_spread

CACHED_NAME = "jul"  # the enum value of the cached schema; a new schema's is 3 capitals (`fresh_name`)
FRESH_SCHEMAS = 26**3  # distinct new schemas (AAA..ZZZ): more requests than a run sends at 1 stream
FRESH_CONCURRENCY = 1
ENDPOINT = "POST /v1/generate (stream, greedy, json_schema)"
FRESH_ENDPOINT = "POST /v1/generate (stream, greedy, a new json_schema each)"
SAMPLE_TIMEOUT_S = 120.0


def case_name(concurrency: int, fresh: bool = False) -> str:
    return f"gpt json{'-new' if fresh else ''} c={concurrency}"


def schema(name: str = CACHED_NAME) -> dict:
    """The schema, 8 bounded properties (a scene's line); `name` is the last value of the `w` enum (who speaks)."""
    properties = {
        "a": {"type": "integer", "minimum": 1, "maximum": 5},  # act
        "s": {"type": "integer", "minimum": 1, "maximum": 9},  # scene
        "l": {"type": "integer", "minimum": 0, "maximum": 99},  # line
        "w": {"enum": ["rom", "nur", name]},  # who
        "x": {"type": "boolean"},  # exits
        "q": {"type": "string", "maxLength": 3, "pattern": "^[a-z]*$"},  # a word
        "m": {"enum": [0, 1, 2]},  # mood
        "n": {"type": "integer", "minimum": 0, "maximum": 9},  # lines left
    }
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def fresh_name(index: int) -> str:
    """The `index`-th new schema's enum value: 3 capitals (AAA, AAB, ...), never the cached schema's."""
    letters = string.ascii_uppercase
    return "".join(letters[index // 26**k % 26] for k in (2, 1, 0))


def longest_document(of: dict) -> dict:
    """The longest document `of` (this module's schema) admits: its properties' longest values."""

    def longest(node: dict):
        if "enum" in node:
            return max(node["enum"], key=lambda v: len(json.dumps(v)))
        if node["type"] == "integer":
            return max(node["minimum"], node["maximum"], key=lambda v: len(str(v)))
        if node["type"] == "boolean":
            return False
        if node["type"] == "string":
            return "a" * node["maxLength"]
        raise ValueError(f"no longest value for {node}")

    return {key: longest(node) for key, node in of["properties"].items()}


def compact(document) -> str:
    """A document as the service writes it under a schema: compact JSON."""
    return json.dumps(document, separators=(",", ":"))


def body(prompt: str, max_new_tokens: int, of: dict, stream: bool = True) -> bytes:
    return json.dumps({"prompt": prompt, "max_new_tokens": max_new_tokens, "temperature": 0, "stream": stream,
                       "json_schema": of}).encode()


class FreshSchemaBodies(Sequence):
    """Request bodies made as they are sent (the load cycles through `bodies[i % len]`): the i-th with the i-th
    prompt (cycling) and the i-th new schema, so that no two requests of a run share a schema."""

    def __init__(self, prompts: list[str], max_new_tokens: int):
        self.prompts, self.max_new_tokens = prompts, max_new_tokens

    def __len__(self) -> int:
        return FRESH_SCHEMAS

    def __getitem__(self, index: int) -> bytes:
        if not 0 <= index < FRESH_SCHEMAS:
            raise IndexError(index)
        return body(self.prompts[index % len(self.prompts)], self.max_new_tokens, schema(fresh_name(index)))


def constrained_workload(prompts: list[str], max_new_tokens: int, fresh: bool = False) -> Workload:
    """The gpt case's requests (`cases.gpt_workload`), each with the schema: the same one, or a new one each."""
    bodies = FreshSchemaBodies(prompts, max_new_tokens) if fresh else \
        [body(p, max_new_tokens, schema()) for p in prompts]
    return Workload("/v1/generate", bodies, JSON_HEADERS, stream=True, unit="tokens/s")


def sample(server: ServiceProcess, prompt: str, max_new_tokens: int) -> dict:
    """One request with the schema, not streamed (this also compiles it): its text, tokens, finish reason and
    whether jsonschema finds it valid. RuntimeError when the service refuses it."""
    import httpx

    try:
        response = httpx.post(f"{server.url}/v1/generate", headers=JSON_HEADERS, timeout=SAMPLE_TIMEOUT_S,
                              content=body(prompt, max_new_tokens, schema(), stream=False))
        response.raise_for_status()
    except httpx.HTTPError as error:  # e.g. a service without constraints: the case is skipped, the run goes on
        raise RuntimeError(f"the constrained sample request failed: {error}") from None
    payload = response.json()
    try:
        import jsonschema
    except ImportError:
        valid = None
    else:
        try:
            valid = jsonschema.Draft202012Validator(schema()).is_valid(json.loads(payload["text"]))
        except ValueError:  # not JSON
            valid = False
    return {"text": payload["text"], "tokens": payload["usage"]["completion_tokens"],
            "finish_reason": payload["finish_reason"], "valid": valid}


def constrained_cases(server: ServiceProcess, model: str, prompts: list[str], max_new_tokens: int,
                      concurrencies: list[int]) -> tuple[list[Case], dict]:
    """The cases (the cached schema at `concurrencies`, a new schema each at 1 stream) and what was checked first:
    a sample document, validated, and whether the longest document fits `max_new_tokens`."""
    longest = len(compact(longest_document(schema())))
    info = {"schema": schema(), "longest_document_bytes": longest, "sample": sample(server, prompts[0], max_new_tokens)}
    print(f"  constrained sample ({info['sample']['tokens']} tokens, {info['sample']['finish_reason']}, valid: "
          f"{info['sample']['valid']}): {info['sample']['text']}", flush=True)
    if longest > max_new_tokens:
        print(f"  note: the schema's longest document is {longest} bytes: with max_new_tokens {max_new_tokens} some "
              "constrained requests may end \"length\"", flush=True)
    cached = constrained_workload(prompts, max_new_tokens)
    cases = [Case(case_name(c), ENDPOINT, server, cached, c, model) for c in concurrencies]
    cases.append(Case(case_name(FRESH_CONCURRENCY, fresh=True), FRESH_ENDPOINT, server,
                      constrained_workload(prompts, max_new_tokens, fresh=True), FRESH_CONCURRENCY, model))
    return cases, info


class ConstrainedRatio(NamedTuple):
    """One ratio of the constrained case: `metric` ("throughput" or "ttft_p50") of `numerator` over `denominator`,
    with the --cases entry that runs each."""

    label: str
    metric: str
    numerator: str
    numerator_option: str
    denominator: str
    denominator_option: str


def constrained_ratios(concurrencies: list[int]) -> list[ConstrainedRatio]:
    ratios = [ConstrainedRatio(f"constrained/unconstrained {c} streams tokens/s", "throughput", case_name(c),
                               "constrained", f"gpt c={c}", "gpt") for c in concurrencies]
    new, cached, free = case_name(1, fresh=True), case_name(1), "gpt c=1"
    ratios += [ConstrainedRatio("new schema/unconstrained 1 stream TTFT p50", "ttft_p50", new, "constrained", free,
                                "gpt"),
               ConstrainedRatio("cached schema/unconstrained 1 stream TTFT p50", "ttft_p50", cached, "constrained",
                                free, "gpt"),
               ConstrainedRatio("new schema/cached schema 1 stream TTFT p50", "ttft_p50", new, "constrained", cached,
                                "constrained")]
    return ratios


def evaluate_constrained(cases: list[dict], ratios: list[ConstrainedRatio], skipped: dict[str, str]) -> list[dict]:
    """Each ratio's row, shaped like the peers' (`report.evaluate_peers`): the value (None, with the `reason`, when
    a case did not run), both figures, the mean tokens per request of each case and the errors in them."""
    by_case = {c["case"]: c for c in cases}
    rows = []
    for ratio in ratios:
        a, b = by_case.get(ratio.numerator), by_case.get(ratio.denominator)
        x, y = case_metric(a, ratio.metric), case_metric(b, ratio.metric)
        value = x / y if x is not None and y else None
        reason = None
        if value is None:
            missing = ratio.numerator_option if a is None else ratio.denominator_option if b is None else None
            reason = (skipped.get(missing) or NOT_MEASURED.format(option=missing)) if missing else \
                f"no {ratio.metric} in {ratio.numerator if x is None else ratio.denominator}"
        rows.append({"ratio": ratio.label, "value": value, "reason": reason, "metric": ratio.metric,
                     "unit": "tokens/s" if ratio.metric == "throughput" else "ms",
                     "numerator": ratio.numerator, "denominator": ratio.denominator,
                     "numerator_value": x, "denominator_value": y,
                     "tokens_per_request": [s and s["work_per_request"] for s in (a, b)],
                     "errors_in_cases": (a["errors"] if a else 0) + (b["errors"] if b else 0),
                     "spread": case_spread(a, b, ratio.metric)})
    return rows


def print_constrained(rows: list[dict]) -> None:
    if not rows:
        return
    print("\nConstrained GPT (json_schema) against unconstrained, measured in this run (tokens/s > 1: constrained "
          "faster per token; TTFT < 1: constrained sooner):")
    for row in rows:
        figures = ""
        if row["value"] is not None:
            figures = f"   ({row['numerator_value']:,.1f} vs {row['denominator_value']:,.1f} {row['unit']}"
            if row["metric"] == "throughput":
                figures += "; tokens per request {:.1f} vs {:.1f}".format(*row["tokens_per_request"])
            figures += ")"
        print(peer_line(row) + figures)
        print_spread(row["ratio"], row["spread"])
