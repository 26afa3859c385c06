"""What issue 55's cases share (prefix.py, lmeval.py, speculation.py): a GPT-only server per setting, a case that
also counts the service's counters (prefix-cache tokens, draft tokens), ratios of two cases with a goal, printed
like the peers' (`report.peer_line`) under the CPU they ran on, and the text windows the prompts are cut from.

A ratio is of two cases run in this run, each on its own server (`ABRatio`): `metric` "throughput" (work/s),
"ttft_p50" (ms) or "time_per_request" (ms of wall time per successful request: a fixed list of requests takes
this much longer or shorter, as an lm-eval run would); its goal, `("<=", 0.3)` or `(">=", 0.97)`, prints PASS or
MISS beside it (errors in either case void a PASS, as `report.evaluate_goals` judges)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import NamedTuple

from spread import judge

from service.client.launcher import ServiceProcess

from .cases import Case
from .report import NOT_MEASURED, case_metric, case_spread, peer_line, print_spread
from .servers import metric_totals, service_server

# the service's counters a case reads before and after each round (`CountingCase`), without `_total`
PREFIX_COUNTERS = ("tserve_prefix_cache_queries", "tserve_prefix_cache_hits")
SPEC_COUNTERS = ("tserve_spec_decode_num_draft_tokens", "tserve_spec_decode_num_accepted_tokens")
SCREEN_CONCURRENCY = 16  # the untimed requests that pick prompts (`post_all`)
SCREEN_TIMEOUT_S = 300.0


def gpt_server(args, name: str, repository, model: str, env: dict[str, str]) -> ServiceProcess:
    """The GPT alone (`models=[model]`) on `repository`, with `env` (the setting under test) over --server-env."""
    return service_server(args, name, repository, vit_batching=False, models=[model], env=env)


@dataclass
class CountingCase(Case):
    """A case that also sums how much the service's `counters` grew over its rounds (from /metrics, all models:
    each of these cases runs on a server of one model, alone while it runs)."""

    counters: tuple[str, ...] = ()
    counted: dict[str, float] = field(default_factory=dict)

    def run_round(self, duration: float, requests: int | None, timeout: float):
        before = metric_totals(self.server.url, self.counters) if self.counters else {}
        results = super().run_round(duration, requests, timeout)
        if self.counters:
            after = metric_totals(self.server.url, self.counters)
            for name in self.counters:
                if name in before and name in after:
                    self.counted[name] = self.counted.get(name, 0.0) + after[name] - before[name]
        return results

    def summary(self) -> dict:
        return {**super().summary(), "counters": dict(self.counted)}


def cached_share(summary: dict | None) -> float | None:
    """Prompt tokens found in the prefix cache / prompt tokens looked up, over a case's rounds (warm-ups out)."""
    counted = (summary or {}).get("counters") or {}
    queries = counted.get("tserve_prefix_cache_queries")
    return counted.get("tserve_prefix_cache_hits", 0.0) / queries if queries else None


def acceptance(summary: dict | None) -> tuple[float, float | None]:
    """(draft tokens, accepted / drafted) over a case's rounds: (0, None) when nothing was drafted."""
    counted = (summary or {}).get("counters") or {}
    drafted = counted.get("tserve_spec_decode_num_draft_tokens", 0.0)
    return drafted, (counted.get("tserve_spec_decode_num_accepted_tokens", 0.0) / drafted if drafted else None)


class ABRatio(NamedTuple):
    """`metric` of case `numerator` over case `denominator`, both run by the --cases entry `option`; `goal`:
    (`"<="` or `">="`, threshold), or None."""

    label: str
    metric: str
    numerator: str
    denominator: str
    option: str
    goal: tuple[str, float] | None = None


UNITS = {"ttft_p50": "ms", "time_per_request": "ms"}


def evaluate(cases: list[dict], ratios: list[ABRatio], skipped: dict[str, str]) -> list[dict]:
    """Each ratio's row, shaped like the peers' (`report.evaluate_peers`) and the constrained case's: the value (None,
    with the `reason`, when a case did not run), both figures, the goal and its status, the errors in the cases."""
    by_case = {c["case"]: c for c in cases}
    rows = []
    for ratio in ratios:
        a, b = by_case.get(ratio.numerator), by_case.get(ratio.denominator)
        x, y = case_metric(a, ratio.metric), case_metric(b, ratio.metric)
        value = x / y if x is not None and y else None
        reason = None
        if value is None:
            if a is None or b is None:
                reason = skipped.get(ratio.option) or NOT_MEASURED.format(option=ratio.option)
            else:
                reason = f"no {ratio.metric} in {ratio.numerator if x is None else ratio.denominator}"
        errors = (a["errors"] if a else 0) + (b["errors"] if b else 0)
        rows.append({"ratio": ratio.label, "value": value, "reason": reason, "metric": ratio.metric,
                     "unit": UNITS.get(ratio.metric) or (a or b or {}).get("unit"),
                     "numerator": ratio.numerator, "denominator": ratio.denominator,
                     "numerator_value": x, "denominator_value": y,
                     "goal": None if ratio.goal is None else f"{ratio.goal[0]} {ratio.goal[1]:g}",
                     "status": judge(value, ratio.goal, errors), "errors_in_cases": errors,
                     "notes": [], "spread": case_spread(a, b, ratio.metric)})
    return rows


def ratio_line(row: dict) -> str:
    """`peer_line` (`label = 0.25`, or `= n/a (why)`), then the goal and its status, both figures and any notes."""
    line = peer_line(row)
    if row["value"] is None:
        return line
    parts = []
    if row["goal"]:
        parts.append(f"goal {row['goal']}: {row['status']}")
    parts.append(f"{row['numerator_value']:,.1f} vs {row['denominator_value']:,.1f} {row['unit']}")
    parts += row["notes"]
    return f"{line}   ({'; '.join(parts)})"


def print_ratios(title: str, cpu_line: str, rows: list[dict]) -> None:
    """The section: its title, the CPU it ran on (a figure holds only beside it), one line per ratio."""
    if not rows:
        return
    print(f"\n{title}, measured in this run on {cpu_line}:")
    for row in rows:
        print(ratio_line(row))
        print_spread(row["ratio"], row["spread"])


# --- the text prompts are cut from ------------------------------------------------------------------------------

def block_starts(text: str, block: int, min_chars: int) -> list[int]:
    """The starts of the non-empty lines of `text` with at least `min_chars` characters after them whose first
    `block` characters begin no earlier listed start's (the first kept): two prompts cut at two of them share no
    first block, so the prefix cache (blocks of `block` tokens, a byte-level GPT: one token per character) can never
    match one with the other."""
    starts, seen = [], set()
    position = 0
    while position <= len(text) - min_chars:
        key = text[position : position + block]
        if not key.startswith("\n") and key not in seen:
            seen.add(key)
            starts.append(position)
        newline = text.find("\n", position)
        if newline < 0:
            break
        position = newline + 1
    return starts


def split_starts(starts: list[int], parts: int) -> list[list[int]]:
    """`starts` dealt round-robin into `parts` lists: each workload's prompts spread over the whole text, and no
    two workloads' prompts start alike (the servers' caches are shared by the cases on them)."""
    return [starts[i::parts] for i in range(parts)]


# --- untimed requests (choosing prompts) ------------------------------------------------------------------------

async def _post_all(url: str, path: str, bodies: list[dict], concurrency: int, timeout: float) -> list[dict | None]:
    import httpx

    answers: list[dict | None] = [None] * len(bodies)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:

        async def post(i: int, body: dict) -> None:
            async with gate:
                try:
                    response = await client.post(path, content=json.dumps(body).encode(),
                                                 headers={"content-type": "application/json"})
                    if response.status_code == 200:
                        answers[i] = response.json()
                except (httpx.HTTPError, ValueError):
                    pass

        await asyncio.gather(*(post(i, body) for i, body in enumerate(bodies)))
    return answers


def post_all(server: ServiceProcess, path: str, bodies: list[dict], concurrency: int = SCREEN_CONCURRENCY,
             timeout: float = SCREEN_TIMEOUT_S) -> list[dict | None]:
    """POST every body (JSON) to the server, `concurrency` at a time: the responses' JSON in order, None for one
    that failed."""
    return asyncio.run(_post_all(server.url, path, bodies, concurrency, timeout))
