"""Every ratio of both benchmarks with its spread over the interleaved rounds (bench/spread.py, issue 56): the
per-round ratios and the flag, the load sampled around the timed rounds, and bench-http computing each printed
ratio's spread from its cases' per-round figures (goals, gRPC/REST, the peers, the constrained and issue-55 ratios),
with the cases keeping those figures round by round. No server and no model: figures made up, or fake work."""

from __future__ import annotations

import json
import sys

import pytest

from tests.support import ROOT

BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import spread  # noqa: E402 - after the sys.path set-up, as the scripts' own
from httpbench import ab, constrained, ct2_offline, prefix, report  # noqa: E402
from httpbench.load import Result, round_figures  # noqa: E402

FLAGGED = f"FLAGGED: rounds disagree by more than {spread.SPREAD_FLAG:.1f}x"


def one_round(work: float, seconds: float = 1.0, ttft_s: float | None = None, requests: int = 1) -> dict:
    """A round's figures (`round_figures`, as `Case.run_round` keeps them) of `requests` back-to-back requests that
    did `work` in all in `seconds`, each with its time to first token."""
    step = seconds / requests
    results = [Result(i * step, (i + 1) * step, work=work / requests, ttft=ttft_s) for i in range(requests)]
    return round_figures(results, stream=ttft_s is not None)


def case(name: str, rounds: list[dict], unit: str = "tokens/s") -> dict:
    """A case summary with its rounds (the whole-run figures from the rounds' totals, as `Case.summary` has them)."""
    wall, work = sum(r["wall_s"] for r in rounds), sum(r["work"] for r in rounds)
    ok = sum(r["ok"] for r in rounds)
    return {"case": name, "unit": unit, "rounds": rounds, "wall_s": wall, "work": work, "ok": ok, "errors": 0,
            "throughput": work / wall, "work_per_request": work / ok, "work_per_server_cpu_s": None,
            "latency_ms": {"p50": 1000.0 * wall / ok}, "ttft_ms": rounds[0]["ttft_ms"]}


def test_the_spread_of_per_round_ratios_and_its_flag():
    assert spread.ratio_spread([2.0, 1.0, 2.0], [1.0, 1.0, 1.0]) == {"median": 2.0, "min": 1.0, "max": 2.0,
                                                                    "rounds": 3, "flagged": True}
    assert spread.ratio_spread([1.3, 1.0], [1.0, 1.0])["flagged"] is False  # the margin itself is not flagged
    # a round without both figures (a case that did no work in it, no time to first token) is left out
    assert spread.ratio_spread([1.0, None, 3.0, 2.0], [1.0, 1.0, 0.0, 1.0])["rounds"] == 2
    assert spread.ratio_spread([], [1.0]) is None and spread.ratio_spread([None], [1.0]) is None
    assert spread.spread_text(spread.ratio_spread([1.1, 1.2, 1.1], [1.0] * 3)) == "rounds 1.10-1.20, median 1.10 of 3"
    assert spread.spread_text(spread.ratio_spread([2.0, 1.0], [1.0] * 2)).endswith("   " + FLAGGED)


def test_the_load_is_sampled_before_and_after_the_block():
    loads: list[tuple[float, float]] = []
    with spread.sampled_load(loads):
        pass
    (before, after), = loads
    assert before >= 0 and after >= 0 and round(before, spread.LOAD_DIGITS) == before
    assert spread.load_text(0.5, 1.25) == "machine load (1-minute average) before / after the timed rounds: 0.50 / 1.25"


@pytest.mark.parametrize(("value", "goal", "errors", "status"), [
    (1.0, (">=", 1.0), 0, "PASS"), (0.99, (">=", 1.0), 0, "MISS"), (0.3, ("<=", 0.3), 0, "PASS"),
    (1.3, (">=", 1.3), 1, "MISS"), (None, (">=", 1.0), 0, None), (2.0, None, 0, None)])
def test_a_goal_is_judged_once_for_both_benchmarks(value, goal, errors, status):
    assert spread.judge(value, goal, errors) == status
    assert ab.judge is spread.judge


def test_a_case_keeps_each_rounds_figures_and_load():
    class Worker:  # ct2.Worker's interface: every source translated to `new_tokens` tokens
        name, pid = "ctranslate2", 0

        def translate(self, sources, num_beams, new_tokens):
            return [[5] * new_tokens for _ in sources]

    offline = ct2_offline.ctranslate2_case(Worker(), [[3, 2]] * 20, num_beams=4, new_tokens=30)
    for requests in (2, 3, 1):
        offline.run_round(0.0, requests=requests, timeout=1.0)
    row = offline.summary()
    assert [r["ok"] for r in row["rounds"]] == [2, 3, 1] and [r["work"] for r in row["rounds"]] == [32, 48, 16]
    assert all(r["throughput"] == r["work"] / r["wall_s"] for r in row["rounds"])
    assert row["wall_s"] == pytest.approx(sum(r["wall_s"] for r in row["rounds"]))
    assert len(row["load_before_after"]) == 3 and all(len(pair) == 2 for pair in row["load_before_after"])
    assert report.case_spread(row, row, "throughput") == {"median": 1.0, "min": 1.0, "max": 1.0, "rounds": 3,
                                                          "flagged": False}
    assert json.loads(json.dumps(row))["rounds"] == row["rounds"]  # as the JSON report holds them


def test_the_peers_ratios_spread_comes_from_the_rounds(capsys):
    # the service 900, 800, 880 tokens/s; llama-server 1000 in two rounds, 400 in the one where it misbehaved
    service = case("gpt c=1", [one_round(900), one_round(800), one_round(880)])
    peer = case("llama-server c=1", [one_round(1000), one_round(1000), one_round(400)])
    rows = report.evaluate_peers([service, peer], report.peer_ratios([1], []), {})
    assert rows[0]["value"] == pytest.approx(2580 / 2400)  # the ratio of the whole run's throughputs
    assert rows[0]["spread"] == pytest.approx({"median": 0.9, "min": 0.8, "max": 2.2, "rounds": 3, "flagged": True})
    assert rows[1]["ratio"] == "service/llama-server-q8_0 1 streams" and rows[1]["spread"] is None  # not run
    report.print_peers(rows)
    out = capsys.readouterr().out
    assert f"service/llama-server 1 streams = 1.07\n  service/llama-server 1 streams: rounds 0.80-2.20, median 0.90 " \
           f"of 3   {FLAGGED}\n" in out


def test_the_goals_and_grpc_comparisons_spread(capsys):
    on = case("vit batching=on", [one_round(300), one_round(330)], "images/s")
    off = case("vit batching=off", [one_round(100), one_round(100)], "images/s")
    goal = next(g for g in report.evaluate_goals([on, off]) if g["goal"] == "vit_batching")
    assert goal["spread"] == pytest.approx({"median": 3.15, "min": 3.0, "max": 3.3, "rounds": 2, "flagged": False})
    assert all(g["spread"] is None for g in report.evaluate_goals([on, off]) if g["goal"] != "vit_batching")
    report.print_goals(report.evaluate_goals([on, off]))
    assert "ViT images/s, dynamic batching on / off: rounds 3.00-3.30, median 3.15 of 2\n" in capsys.readouterr().out
    grpc = case("gpt grpc c=1", [one_round(64, 0.1, ttft_s=0.010), one_round(64, 0.1, ttft_s=0.030)])
    rest = case("gpt c=1", [one_round(64, 0.1, ttft_s=0.010), one_round(64, 0.2, ttft_s=0.010)])
    (row,) = report.evaluate_comparisons([grpc, rest])
    assert row["spread"]["throughput"] == pytest.approx({"median": 1.5, "min": 1.0, "max": 2.0, "rounds": 2,
                                                         "flagged": True})
    assert row["spread"]["latency_p50"]["min"] == pytest.approx(0.5) and row["spread"]["ttft_p50"]["max"] == 3.0
    report.print_comparisons([row])
    assert f"grpc/rest gpt c=1 throughput: rounds 1.00-2.00, median 1.50 of 2   {FLAGGED}" in capsys.readouterr().out


def test_the_constrained_and_ab_ratios_spread(capsys):
    cases = [case("gpt c=1", [one_round(640, ttft_s=0.008, requests=10)] * 3),
             case("gpt json c=1", [one_round(590, ttft_s=t, requests=10) for t in (0.008, 0.009, 0.016)]),
             case("gpt json-new c=1", [one_round(590, ttft_s=0.010, requests=10)] * 3)]
    rows = constrained.evaluate_constrained(cases, constrained.constrained_ratios([1]), {})
    cached = next(r for r in rows if r["ratio"].startswith("cached schema/unconstrained"))
    assert cached["spread"] == pytest.approx({"median": 1.125, "min": 1.0, "max": 2.0, "rounds": 3, "flagged": True})
    constrained.print_constrained(rows)
    assert f"cached schema/unconstrained 1 stream TTFT p50: rounds 1.00-2.00, median 1.12 of 3   {FLAGGED}" in \
        capsys.readouterr().out
    hit = case(prefix.HIT, [one_round(16, ttft_s=0.002), one_round(16, ttft_s=0.003)])
    miss = case(prefix.MISS, [one_round(16, ttft_s=0.010), one_round(16, ttft_s=0.010)])
    (row, *_) = ab.evaluate([hit, miss], prefix.prefix_ratios(), {})
    assert row["spread"] == pytest.approx({"median": 0.25, "min": 0.2, "max": 0.3, "rounds": 2, "flagged": True})
    ab.print_ratios("Prefix caching (issue 55)", "AMD EPYC", [row])
    assert f"prefix hit/miss 1 stream TTFT p50: rounds 0.20-0.30, median 0.25 of 2   {FLAGGED}" in \
        capsys.readouterr().out
