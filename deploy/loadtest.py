"""Report of a locust run (`make loadtest`): a summary table, `<prefix>_summary.json`, a PNG with four plots, and an
exit status that fails the run when too many requests failed.

    python deploy/loadtest.py --prefix reports/loadtest [--max-failure-pct 1.0] [--min-requests 1]

Reads what `locust --csv <prefix> --csv-full-history` and deploy/locust/locustfile.py wrote:
`<prefix>_stats.csv` (totals per request name), `<prefix>_stats_history.csv` (every second: users,
requests/s, failures/s, percentiles over a 10 s window), `<prefix>_failures.csv` (failure messages) and
`<prefix>_extra.json` (client-side time to first token of streams, generated tokens, images, sentences, and
locust's final totals, which win over the CSV's: that is written every second and can miss the last one).

The PNG (`<prefix>.png`), one colour per request name throughout (endpoint_colors), legends right of the axes:
  top left      throughput over time: requests/s and failures/s (all requests), users on the right axis
  top right     latency over time: p50 (solid) and p95 (dashed) of all requests (black) and per request name
  bottom left   latency per request name over the whole run: p50 / p95 / p99 (plain, hatched //, hatched xx)
  bottom right  requests/s per request name, with the failure count written on the bar when there were any
The title line says: requests, failure %, requests/s, tokens/s, images/s, streamed time to first token p50/p95.

Exit status: 0 when the failure percentage is at most --max-failure-pct (and at least --min-requests requests
ran), 1 when more failed, 2 when the files are missing or nothing ran.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

PERCENTILES = ("50%", "95%", "99%")


def _float(value: str | None) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan
    return number


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


def summarize(prefix: Path) -> dict:
    stats_path = Path(f"{prefix}_stats.csv")
    if not stats_path.is_file():
        raise FileNotFoundError(f"{stats_path} not found: run locust with --csv {prefix}")
    rows = _read_csv(stats_path)
    aggregated = next((r for r in rows if r["Name"] == "Aggregated"), None)
    if aggregated is None:
        raise ValueError(f"{stats_path}: no Aggregated row")
    history_path = Path(f"{prefix}_stats_history.csv")
    history = _read_csv(history_path) if history_path.is_file() else []
    total_history = [h for h in history if h["Name"] == "Aggregated"]
    duration = (int(total_history[-1]["Timestamp"]) - int(total_history[0]["Timestamp"])) if len(total_history) > 1 \
        else math.nan
    extra_path = Path(f"{prefix}_extra.json")
    extra = json.loads(extra_path.read_text()) if extra_path.is_file() else {}
    failures_path = Path(f"{prefix}_failures.csv")
    failures = _read_csv(failures_path) if failures_path.is_file() else []

    requests = int(aggregated["Request Count"])
    failed = int(aggregated["Failure Count"])
    rps = _float(aggregated["Requests/s"])
    endpoints = {}
    for row in rows:
        if row["Name"] == "Aggregated":
            continue
        endpoints[row["Name"]] = {
            "requests": int(row["Request Count"]), "failures": int(row["Failure Count"]),
            "requests_per_s": _float(row["Requests/s"]), "mean_ms": _float(row["Average Response Time"]),
            **{f"p{p[:-1]}_ms": _float(row.get(p)) for p in PERCENTILES},
        }
    seconds = requests / rps if rps > 0 else math.nan
    final = extra.get("final")
    if final:  # locust's own totals at the end (the CSV can miss the last second)
        requests, failed = final["total"]["requests"], final["total"]["failures"]
        rps, seconds = final["total"]["requests_per_s"], final["seconds"]
        endpoints = {name: {k: math.nan if v is None else v for k, v in e.items()}
                     for name, e in sorted(final["endpoints"].items())}
        aggregated = {f"{q}%": final["total"][f"p{q}_ms"] for q in (50, 95, 99)}
    tokens = sum((extra.get("generated_tokens") or {}).values())
    ttft = extra.get("ttft_ms") or []
    per_s = (lambda n: n / seconds) if seconds and seconds == seconds else (lambda n: 0.0)
    return {
        "requests": requests, "failures": failed,
        "failure_pct": 100.0 * failed / requests if requests else math.nan,
        "requests_per_s": rps,
        "p50_ms": _float(aggregated.get("50%")), "p95_ms": _float(aggregated.get("95%")),
        "p99_ms": _float(aggregated.get("99%")), "seconds": seconds,
        "duration_s": duration, "max_users": max((int(h["User Count"]) for h in total_history), default=0),
        "generated_tokens_per_s": per_s(tokens), "images_per_s": per_s(extra.get("images", 0)),
        "sentences_per_s": per_s(sum((extra.get("sentences") or {}).values())),
        "stream_ttft_p50_ms": _percentile(ttft, 50), "stream_ttft_p95_ms": _percentile(ttft, 95),
        "endpoints": endpoints,
        "failure_messages": [{"name": f["Name"], "error": f["Error"], "occurrences": int(f["Occurrences"])}
                             for f in failures],
        "settings": extra.get("settings", {}),
        "_history": history,
    }


def _finite(value):
    """NaN (no data) -> None, so the summary is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _title(s: dict) -> str:
    return (f"{s['requests']} requests, {s['failure_pct']:.2f}% failed, {s['requests_per_s']:.1f} req/s, "
            f"{s['generated_tokens_per_s']:.0f} tokens/s, {s['images_per_s']:.1f} images/s, "
            f"stream TTFT p50 {s['stream_ttft_p50_ms']:.0f} ms / p95 {s['stream_ttft_p95_ms']:.0f} ms, "
            f"{s['max_users']} users")


# One colour per request name in every panel: tab10's ten, then tab20's lighter ten, so that up to 20 names never
# share one (locust's default cycle repeats after ten: classify p95 and translate beam p95 were both blue); past 20,
# evenly spaced hues of a perceptually ordered map.
_PALETTE_SIZE = 20
# Line style (time series) and hatch (bars) per percentile; a colour says which request, a pattern which percentile.
PERCENTILE_STYLES = {"50%": "-", "95%": "--", "99%": ":"}
PERCENTILE_HATCHES = {"50%": "", "95%": "//", "99%": "xx"}
# Over time only p50 and p95: a 10 s window holds too few requests for its p99 to be more than noise.
OVER_TIME_PERCENTILES = ("50%", "95%")
# Legends sit right of their axes, clear of the data, starting at the axes' top edge.
_LEGEND_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.02, 1.0), "borderaxespad": 0.0, "fontsize": 8}


def endpoint_colors(names: list[str]) -> dict[str, tuple]:
    """A distinct colour per request name, in the order given."""
    import matplotlib

    if len(names) <= _PALETTE_SIZE:
        tab10, tab20 = matplotlib.colormaps["tab10"], matplotlib.colormaps["tab20"]
        palette = [tab10(i) for i in range(10)] + [tab20(2 * i + 1) for i in range(10)]
    else:
        turbo = matplotlib.colormaps["turbo"]
        palette = [turbo(0.05 + 0.9 * i / (len(names) - 1)) for i in range(len(names))]
    return dict(zip(names, palette))


def figure(summary: dict):
    """The report's four panels as a matplotlib Figure (not yet saved): see the module docstring."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    history = summary["_history"]
    names = list(summary["endpoints"])
    colors = endpoint_colors(names)
    fig, axes = plt.subplots(2, 2, figsize=(17, 10), layout="constrained")
    fig.suptitle(f"Load test: {_title(summary)}", fontsize=10)

    total = [h for h in history if h["Name"] == "Aggregated"]
    if total:
        t0 = int(total[0]["Timestamp"])
        t = [int(h["Timestamp"]) - t0 for h in total]
        ax = axes[0][0]
        ax.plot(t, [_float(h["Requests/s"]) for h in total], label="requests/s", color="black")
        ax.plot(t, [_float(h["Failures/s"]) for h in total], label="failures/s", color="tab:red")
        ax.set(title="Throughput over time", xlabel="seconds", ylabel="per second")
        users = ax.twinx()
        users.plot(t, [int(h["User Count"]) for h in total], color="grey", linestyle=":", label="users")
        users.set_ylabel("users")
        lines, labels = ax.get_legend_handles_labels()
        more_lines, more_labels = users.get_legend_handles_labels()
        # past the twin axis' tick labels and title on the right
        ax.legend(lines + more_lines, labels + more_labels, **{**_LEGEND_OUTSIDE, "bbox_to_anchor": (1.12, 1.0)})

        ax = axes[0][1]
        for p in OVER_TIME_PERCENTILES:
            ax.plot(t, [_float(h[p]) for h in total], label=f"all p{p[:-1]}", color="black",
                    linestyle=PERCENTILE_STYLES[p], linewidth=2)
        for name in names:
            rows = [h for h in history if h["Name"] == name]
            if not rows:
                continue
            for p in OVER_TIME_PERCENTILES:
                ax.plot([int(h["Timestamp"]) - t0 for h in rows], [_float(h[p]) for h in rows],
                        label=f"{name} p{p[:-1]}", color=colors[name], linestyle=PERCENTILE_STYLES[p], alpha=0.8)
        ax.set(title="Latency over time (10 s window)", xlabel="seconds", ylabel="ms")
        # one entry per request (its colour) and one per percentile (its line style), not one per line
        handles = [Line2D([], [], color="black", linewidth=2, label="all requests")]
        handles += [Line2D([], [], color=colors[n], label=n) for n in names]
        handles += [Line2D([], [], color="black", linestyle=PERCENTILE_STYLES[p], label=f"p{p[:-1]}")
                    for p in OVER_TIME_PERCENTILES]
        ax.legend(handles=handles, **_LEGEND_OUTSIDE)
    else:
        for ax in axes[0]:
            ax.text(0.5, 0.5, "no stats history (locust --csv-full-history)", ha="center", transform=ax.transAxes)

    width = 0.27
    ax = axes[1][0]
    for i, p in enumerate(PERCENTILES):
        key = f"p{p[:-1]}_ms"
        ax.bar([j + (i - 1) * width for j in range(len(names))], [summary["endpoints"][n][key] for n in names],
               width, color=[colors[n] for n in names], hatch=PERCENTILE_HATCHES[p], edgecolor="black",
               linewidth=0.5, label=f"p{p[:-1]}")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set(title="Latency per request (whole run)", ylabel="ms")
    ax.legend(handles=[Patch(facecolor="white", edgecolor="black", hatch=PERCENTILE_HATCHES[p], label=f"p{p[:-1]}")
                       for p in PERCENTILES], **_LEGEND_OUTSIDE)

    ax = axes[1][1]
    bars = ax.bar(names, [summary["endpoints"][n]["requests_per_s"] for n in names],
                  color=[colors[n] for n in names])
    for bar, name in zip(bars, names):
        failed = summary["endpoints"][name]["failures"]
        label = f"{summary['endpoints'][name]['requests']}" + (f"\n{failed} failed" if failed else "")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8, color="tab:red" if failed else "black")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set(title="Requests/s per request (count on the bar)", ylabel="requests/s")
    return fig


def plot(summary: dict, out: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(summary)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python deploy/loadtest.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=Path, default=Path("reports/loadtest"), help="locust's --csv prefix")
    parser.add_argument("--max-failure-pct", type=float, default=1.0,
                        help="fail (exit 1) when more than this percentage of requests failed (default 1)")
    parser.add_argument("--min-requests", type=int, default=1, help="fail (exit 2) with fewer requests")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    try:
        summary = summarize(args.prefix)
    except (FileNotFoundError, ValueError) as error:
        print(f"loadtest: {error}", file=sys.stderr)
        return 2
    history = summary.pop("_history")
    Path(f"{args.prefix}_summary.json").write_text(json.dumps(_finite(summary), indent=2))
    if not args.no_plot:
        plot({**summary, "_history": history}, Path(f"{args.prefix}.png"))

    width = max([18, *map(len, summary["endpoints"])])
    print(f"{'request':<{width}} {'count':>7} {'failed':>6} {'req/s':>7} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8}")
    for name, e in summary["endpoints"].items():
        print(f"{name:<{width}} {e['requests']:>7} {e['failures']:>6} {e['requests_per_s']:>7.2f} {e['p50_ms']:>8.0f} "
              f"{e['p95_ms']:>8.0f} {e['p99_ms']:>8.0f}")
    print(_title(summary))
    for failure in summary["failure_messages"][:10]:
        print(f"  failed: {failure['name']}: {failure['error']} (x{failure['occurrences']})")
    outputs = [f"{args.prefix}_summary.json"] + ([] if args.no_plot else [f"{args.prefix}.png"])
    print(f"wrote {', '.join(outputs)}")

    if summary["requests"] < args.min_requests:
        print(f"loadtest: FAIL: {summary['requests']} requests, fewer than {args.min_requests}", file=sys.stderr)
        return 2
    if summary["failure_pct"] > args.max_failure_pct:
        print(f"loadtest: FAIL: {summary['failure_pct']:.2f}% of requests failed, more than the "
              f"{args.max_failure_pct}% allowed", file=sys.stderr)
        return 1
    print(f"loadtest: PASS: {summary['failure_pct']:.2f}% failed (at most {args.max_failure_pct}% allowed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
