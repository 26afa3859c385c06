"""The load test works end to end: deploy/locust/locustfile.py runs headless for ~15 s against a live service with
real inputs and every task succeeds (zero failures), the OpenAI-compatible ones included, through API-key
authentication (the service has a key, the load test sends it), the gRPC tasks too; then deploy/loadtest.py writes the summary and the
PNG and passes; and the report fails (exit 1) when the failures exceed the threshold.

Needs locust (the project's `load` extra); a missing one fails the test, it does not skip.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service.client.launcher import ServiceProcess, clean_environment
from service.client.processes import free_port
from tests.support import ROOT

pytestmark = pytest.mark.slow

LOCUSTFILE = ROOT / "deploy" / "locust" / "locustfile.py"
REPORT = ROOT / "deploy" / "loadtest.py"
TASK_NAMES = {"translate greedy", "translate beam", "generate", "generate stream", "classify", "openai completion",
              "openai completion stream", "openai chat", "openai chat stream", "oip translate", "oip generate",
              "oip classify", "grpc generate stream", "grpc classify"}
STREAM_NAMES = ("generate stream", "openai completion stream", "openai chat stream", "grpc generate stream")
API_KEY = "loadtest-smoke-key-0123456789"


def require_locust() -> None:
    if importlib.util.find_spec("locust") is None:
        pytest.fail("locust is not installed: it is the project's `load` extra; .ci/run must install the venv "
                    "with it (pip install -e '.[train,dev,load]')")




def read_stats(prefix: Path) -> dict[str, dict[str, str]]:
    with open(f"{prefix}_stats.csv", newline="") as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def test_locust_smoke_against_a_live_service(tiny_repository, data_dir, tmp_path):
    require_locust()
    # the service reads .env in its working directory (pydantic-settings): every /v1 request needs the key
    (tmp_path / ".env").write_text(f"TSERVE_API_KEYS={json.dumps([API_KEY])}\n")
    grpc_port = free_port()
    service = ServiceProcess("service", tiny_repository, tmp_path, ready_timeout=180, intra_op_threads=1,
                             grpc_port=grpc_port, calibration_cache="")
    locust_log = tmp_path / "locust.log"
    prefix = tmp_path / "loadtest"
    try:
        service.start()
        assert httpx.get(f"{service.url}/v1/models", timeout=5).status_code == 401, "the key is not on"

        # the tiny GPT's context is 64 tokens: 16 prompt + 24 new (chat: 17 more of template, 17 fewer new)
        load_env = {**clean_environment(), "TSERVE_DATA_DIR": str(data_dir), "TSERVE_LOAD_PROMPT_CHARS": "16",
                    "TSERVE_LOAD_MAX_NEW_TOKENS": "24", "TSERVE_LOAD_THINK_S": "0.05", "TSERVE_LOAD_API_KEY": API_KEY,
                    "TSERVE_LOAD_GRPC_HOST": f"127.0.0.1:{grpc_port}"}
        command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
                   "--users", "4", "--spawn-rate", "4", "--run-time", "15s", "--stop-timeout", "20",
                   "--host", service.url, "--csv", str(prefix), "--csv-full-history",
                   "--html", str(tmp_path / "loadtest.html"), "--exit-code-on-error", "1", "--loglevel", "WARNING"]
        with locust_log.open("wb") as out:
            locust = subprocess.run(command, cwd=tmp_path, env=load_env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, timeout=120)
        assert locust.returncode == 0, f"locust exited with {locust.returncode}"

        stats = read_stats(prefix)
        total = stats["Aggregated"]
        assert int(total["Failure Count"]) == 0
        assert int(total["Request Count"]) >= 20
        for name in TASK_NAMES:
            assert name in stats and int(stats[name]["Request Count"]) >= 1, f"no {name!r} request ran"
        extra = json.loads(Path(f"{prefix}_extra.json").read_text())
        assert extra["images"] >= 1 and len(extra["ttft_ms"]) >= len(STREAM_NAMES)
        assert all(extra["generated_tokens"][name] > 0 for name in STREAM_NAMES), extra["generated_tokens"]
        assert extra["settings"]["api_key"] is True and API_KEY not in json.dumps(extra)
        assert (tmp_path / "loadtest.html").stat().st_size > 0

        report = subprocess.run([sys.executable, str(REPORT), "--prefix", str(prefix), "--max-failure-pct", "0"],
                                capture_output=True, text=True, timeout=120)
        assert report.returncode == 0, report.stdout + report.stderr
        assert "loadtest: PASS" in report.stdout
        png = Path(f"{prefix}.png").read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000
        summary = json.loads(Path(f"{prefix}_summary.json").read_text())
        # the totals are locust's final ones (its CSV is written every second and may miss the last)
        assert summary["failures"] == 0 and summary["requests"] == extra["final"]["total"]["requests"]
        assert summary["requests"] >= int(total["Request Count"])
        assert set(summary["endpoints"]) == TASK_NAMES
        assert summary["generated_tokens_per_s"] > 0 and summary["images_per_s"] > 0
        print(report.stdout)
    except BaseException:
        print(service.output()[-20000:])
        if locust_log.exists():
            print(f"----- {locust_log.name} -----\n{locust_log.read_text(errors='replace')[-20000:]}")
        raise
    finally:
        service.stop()


def test_report_fails_over_the_failure_threshold(tmp_path):
    """deploy/loadtest.py on a synthetic run with 3% failures: exit 1 at a 1% threshold, 0 at 5%."""
    prefix = tmp_path / "run"
    percentiles = ["50%", "66%", "75%", "80%", "90%", "95%", "98%", "99%", "99.9%", "99.99%", "100%"]
    header = ["Type", "Name", "Request Count", "Failure Count", "Median Response Time", "Average Response Time",
              "Min Response Time", "Max Response Time", "Average Content Size", "Requests/s", "Failures/s",
              *percentiles]
    rows = [["POST", "classify", 100, 3, 20, 25, 5, 90, 300, 10.0, 0.3, *[20] * 11],
            ["", "Aggregated", 100, 3, 20, 25, 5, 90, 300, 10.0, 0.3, *[20] * 11]]
    with open(f"{prefix}_stats.csv", "w", newline="") as f:
        csv.writer(f).writerows([header, *rows])
    history_header = ["Timestamp", "User Count", "Type", "Name", "Requests/s", "Failures/s", *percentiles,
                      "Total Request Count", "Total Failure Count"]
    with open(f"{prefix}_stats_history.csv", "w", newline="") as f:
        csv.writer(f).writerows([history_header] + [
            [1_000 + t, 4, "", "Aggregated", 10.0, 0.3, *[20] * 11, 10 * t, t // 3] for t in range(10)])
    with open(f"{prefix}_failures.csv", "w", newline="") as f:
        csv.writer(f).writerows([["Method", "Name", "Error", "Occurrences"], ["POST", "classify", "HTTP 503", 3]])

    def report(threshold: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPORT), "--prefix", str(prefix), "--max-failure-pct", threshold],
                              capture_output=True, text=True, timeout=120)

    failing = report("1")
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert "3.00% of requests failed" in failing.stderr and "HTTP 503" in failing.stdout
    passing = report("5")
    assert passing.returncode == 0, passing.stdout + passing.stderr
    assert Path(f"{prefix}.png").stat().st_size > 0
    missing = subprocess.run([sys.executable, str(REPORT), "--prefix", str(tmp_path / "nothing")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "not found" in missing.stderr
