"""The load-test report's PNG (deploy/loadtest.py) is readable: every legend sits outside its axes (none covers the
first seconds of latency data), every request name has a colour of its own in every panel (locust's default cycle
repeats after ten: classify p95 and translate beam p95 were both blue), and a percentile has one line style.

Rendered through matplotlib's own objects from a small synthetic locust run (the CSVs `locust --csv --csv-full-history`
writes), for a few request counts up to more than the palette's 20.
"""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest
from tests.support import ROOT

PERCENTILES = ["50%", "66%", "75%", "80%", "90%", "95%", "98%", "99%", "99.9%", "99.99%", "100%"]
SECONDS = 30  # history rows per request name: one a second, as locust writes them


def load_report():
    spec = importlib.util.spec_from_file_location("loadtest_report", ROOT / "deploy" / "loadtest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_locust_run(prefix: Path, names: list[str]) -> None:
    """<prefix>_stats.csv and <prefix>_stats_history.csv of a run over `names`, latencies growing with time and
    differing per name (so that lines do not lie on top of each other)."""
    header = ["Type", "Name", "Request Count", "Failure Count", "Median Response Time", "Average Response Time",
              "Min Response Time", "Max Response Time", "Average Content Size", "Requests/s", "Failures/s",
              *PERCENTILES]
    rows = [["POST", name, 100 + i, i % 3, 20 + i, 25 + i, 5, 90 + i, 300, 10.0 + i, 0.1,
             *[20 + 3 * i + 2 * k for k in range(len(PERCENTILES))]] for i, name in enumerate(names)]
    total = sum(100 + i for i in range(len(names)))
    rows.append(["", "Aggregated", total, 0, 30, 35, 5, 200, 300, 10.0 * len(names), 0.1, *[30] * len(PERCENTILES)])
    with open(f"{prefix}_stats.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    history_header = ["Timestamp", "User Count", "Type", "Name", "Requests/s", "Failures/s", *PERCENTILES,
                      "Total Request Count", "Total Failure Count"]
    history = []
    for t in range(SECONDS):
        for i, name in enumerate(["Aggregated", *names]):
            history.append([1_000 + t, 4, "", name, 10.0, 0.0,
                            *[10 + t + 5 * i + 2 * k for k in range(len(PERCENTILES))], 10 * t, 0])
    with open(f"{prefix}_stats_history.csv", "w", newline="") as f:
        csv.writer(f).writerows([history_header, *history])


@pytest.mark.parametrize("count", [1, 5, 12, 24], ids=lambda n: f"{n}-requests")
def test_legends_outside_the_axes_and_a_colour_per_request(tmp_path, count):
    report = load_report()
    names = [f"request {i}" for i in range(count)]
    prefix = tmp_path / "run"
    write_locust_run(prefix, names)
    fig = report.figure(report.summarize(prefix))
    try:
        fig.canvas.draw()  # lays the figure out (constrained layout), as savefig does
        renderer = fig.canvas.get_renderer()
        (throughput, latency), (per_request, requests_per_s) = fig.axes[0:2], fig.axes[2:4]
        legends = [(ax, ax.get_legend()) for ax in fig.axes if ax.get_legend() is not None]
        assert {ax for ax, _ in legends} == {throughput, latency, per_request}
        for ax, legend in legends:
            box, drawn = ax.get_window_extent(renderer), legend.get_window_extent(renderer)
            assert not box.overlaps(drawn), f"{ax.get_title()!r}: the legend {drawn} covers the axes {box}"
            assert fig.bbox.contains(drawn.x0, drawn.y0) and fig.bbox.contains(drawn.x1, drawn.y1), \
                f"{ax.get_title()!r}: the legend {drawn} is cut off by the figure {fig.bbox}"
        for ax in (throughput, latency, per_request, requests_per_s):  # nor does one cover another panel
            for _, legend in legends:
                assert not ax.get_window_extent(renderer).overlaps(legend.get_window_extent(renderer))

        # the latency lines: "<name> p50" / "<name> p95"; one colour per name, one line style per percentile
        colours, styles = {}, {}
        for line in latency.get_lines():
            name, _, percentile = line.get_label().rpartition(" ")
            if name in names:
                colours.setdefault(name, set()).add(line.get_color() if isinstance(line.get_color(), str)
                                                    else tuple(line.get_color()))
                styles.setdefault(percentile, set()).add(line.get_linestyle())
        assert set(colours) == set(names) and all(len(c) == 1 for c in colours.values()), colours
        assert len({next(iter(c)) for c in colours.values()}) == count, "two requests share a colour"
        assert set(styles) == {"p50", "p95"} and all(len(s) == 1 for s in styles.values()), styles
        assert len({next(iter(s)) for s in styles.values()}) == len(styles), "two percentiles share a line style"
        legend_labels = [text.get_text() for text in latency.get_legend().get_texts()]
        assert set(names) <= set(legend_labels) and {"p50", "p95"} <= set(legend_labels)

        # the bars: the same colour for a name in both bar panels, a different one for every name
        bar_colours = [tuple(bar.get_facecolor()) for bar in requests_per_s.patches]
        assert len(bar_colours) == count and len(set(bar_colours)) == count
        per_percentile = [tuple(bar.get_facecolor()) for bar in per_request.patches]
        assert per_percentile == bar_colours * 3  # p50, p95, p99 bars of each name in its colour
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_the_report_still_writes_the_png(tmp_path):
    report = load_report()
    prefix = tmp_path / "run"
    write_locust_run(prefix, ["classify", "translate beam"])
    assert report.main(["--prefix", str(prefix), "--max-failure-pct", "100"]) == 0
    assert Path(f"{prefix}.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
