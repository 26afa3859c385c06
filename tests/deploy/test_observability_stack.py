"""The monitoring and load-balancing stack for real, on loopback, with the configs of deploy/:

- a real Prometheus (the `prometheus` binary) with deploy/prometheus/prometheus.yml, alerts.yml and replicas.yml,
  started through deploy/prometheus/entrypoint.sh as compose starts it (expecting TSERVE_REPLICAS=1), its tserve
  job discovering a live `python -m service` process from a file: it scrapes the service, the dashboard's and the
  alerts' PromQL evaluate without errors and give the values the traffic implies, killing the service makes `up` 0
  and the TserveReplicaDown alert pending, and once the dead replica also leaves discovery (as a killed compose
  container leaves DNS) TserveReplicaDown has nothing left to see while TserveReplicasMissing and
  TserveNoReplicaReady are pending;
- a real nginx with deploy/nginx/nginx.conf in front of two service processes: both get traffic, one is killed
  (SIGKILL) mid-run, and no failed request reaches the client.

A missing binary (prometheus, nginx) skips the test on a developer's machine, with one line naming it and the Debian
package that installs it (`tests.support.deploy.require_tool`); only with TSERVE_REQUIRE_TOOLS=1 in the
environment, which .ci/run sets, does it fail the test instead (deploy/ci-packages.txt lists what .ci/run installs).
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from models.data import load_fashion_mnist, load_multi30k
from service.client.launcher import ServiceProcess
from service.client.processes import free_port, stop_process_group
from tests.support.deploy import render_nginx_conf, require_tool, wait_for
from tests.support.images import png_bytes
from tests.support import ROOT

pytestmark = pytest.mark.slow

DEPLOY = ROOT / "deploy"






class Process:
    """A subprocess in its own session with its output in a log file; stop() ends it and its children."""

    def __init__(self, name: str, command: list[str], workdir: Path, env: dict | None = None):
        self.name = name
        self.log_path = workdir / f"{name}.log"
        with self.log_path.open("wb") as out:
            self.popen = subprocess.Popen(command, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)

    def stop(self) -> None:
        stop_process_group(self.popen)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


class Service(ServiceProcess):
    """`python -m service` by the shared launcher, spawned at once (its port is known; wait_ready() later), text
    logs in <workdir>/<name>.log; `popen`, `log()`, `kill()` and `stop()` as a Process's."""

    def __init__(self, name: str, repository: Path, workdir: Path):
        super().__init__(name, repository, workdir, log_path=workdir / f"{name}.log", ready_timeout=180,
                         intra_op_threads=1, log_format="text")
        self.spawn()

    @property
    def popen(self) -> subprocess.Popen:
        return self.proc

    def log(self) -> str:
        return self.output()


@pytest.fixture
def processes(tmp_path):
    """Started processes; all stopped at the end, and their logs printed (pytest shows them when a test fails)."""
    started: list[Process] = []
    yield started
    for process in reversed(started):
        process.stop()
    for process in started:
        print(f"----- {process.name} (exit {process.popen.returncode}) -----\n{process.log()[-20000:]}")


@pytest.fixture(scope="module")
def inputs(data_dir):
    sentences = [de for de, _ in load_multi30k(data_dir, "val")[:50]]
    images, _ = load_fashion_mnist(data_dir, "test")
    return sentences, [png_bytes(image) for image in images[:20]]


# --- Prometheus -------------------------------------------------------------------------------------------------


def grafana_to_promql(expr: str) -> str:
    return expr.replace("$__rate_interval", "1m").replace("$instance", ".*")


def test_prometheus_scrapes_the_service_and_evaluates_dashboard_and_alerts(tiny_repository, tmp_path, processes,
                                                                           inputs):
    prometheus = require_tool("prometheus")
    sentences, pngs = inputs
    service = Service("service", tiny_repository, tmp_path)
    processes.append(service)

    # deploy/prometheus/prometheus.yml, scraping every second, its tserve job discovering the loopback service from
    # a file (compose's DNS discovery in miniature: a target removed from the file is gone, as a killed container
    # is gone from DNS)
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    prom_port = free_port()
    targets_file = tmp_path / "tserve-targets.json"

    def discover(targets: list[str]) -> None:
        staged = targets_file.with_suffix(".tmp")
        staged.write_text(json.dumps([{"targets": targets}]))
        staged.replace(targets_file)  # atomic: Prometheus never reads half a file

    discover([f"127.0.0.1:{service.port}"])
    for job in config["scrape_configs"]:
        job.pop("dns_sd_configs", None)
        if job["job_name"] == "tserve":
            job["file_sd_configs"] = [{"files": [str(targets_file)], "refresh_interval": "1s"}]
        else:
            job["static_configs"] = [{"targets": [f"127.0.0.1:{prom_port}"]}]
    source = tmp_path / "deploy-prometheus"
    source.mkdir()
    for name in ("alerts.yml", "replicas.yml"):
        shutil.copy(DEPLOY / "prometheus" / name, source / name)
    (source / "prometheus.yml").write_text(yaml.safe_dump(config))
    # as compose runs it: deploy/prometheus/entrypoint.sh copies the folder, writes the expected replica count
    # into replicas.yml, and execs the `prometheus` on PATH with --config.file
    env = {**os.environ, "PATH": f"{Path(prometheus).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "TSERVE_REPLICAS": "1", "TSERVE_PROMETHEUS_SOURCE": str(source),
           "TSERVE_PROMETHEUS_CONFIG": str(tmp_path / "prometheus-config")}
    env.pop("TSERVE_EXPECTED_REPLICAS", None)
    processes.append(Process("prometheus", ["/bin/sh", str(DEPLOY / "prometheus" / "entrypoint.sh"),
                                            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                            f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
                             tmp_path, env=env))
    api = httpx.Client(base_url=f"http://127.0.0.1:{prom_port}", timeout=10)

    def query(promql: str) -> list[dict]:
        response = api.get("/api/v1/query", params={"query": promql})
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", f"{promql}: {body}"
        return body["data"]["result"]

    def value(promql: str) -> float:
        result = query(promql)
        return float(result[0]["value"][1]) if result else math.nan

    service.wait_ready()
    wait_for("prometheus ready", lambda: api.get("/-/ready").status_code == 200, 60, processes[-1].popen)
    # traffic only after the first successful scrape, so that rate() sees it as an increase
    wait_for("first scrape of tserve", lambda: value('up{job="tserve"}') == 1, 30)
    wait_for("the expected replica count recorded", lambda: value("tserve:replicas_expected") == 1, 30)
    wait_for("a second scrape of tserve", lambda: value('count_over_time(up{job="tserve"}[1m])') >= 2, 30)

    def send_traffic(client: httpx.Client) -> None:
        for sentence in sentences[:4]:
            for beams in (1, 3):
                assert client.post("/v1/translate", json={"text": sentence, "num_beams": beams}).status_code == 200
        for seed in range(3):
            body = {"prompt": "ROMEO:", "max_new_tokens": 12, "seed": seed}
            assert client.post("/v1/generate", json=body).status_code == 200
            with client.stream("POST", "/v1/generate", json={**body, "stream": True}) as stream:
                assert stream.status_code == 200 and "[DONE]" in stream.read().decode()
        # a constrained request: the dashboard's constrained-requests panel (compiled on the first round, cached after)
        body = {"prompt": "ROMEO:", "max_new_tokens": 12, "regex": "[a-z]{1,8}"}
        assert client.post("/v1/generate", json=body).status_code == 200
        response = client.post("/v1/classify", files=[("files", (f"{i}.png", png, "image/png"))
                                                      for i, png in enumerate(pngs[:5])])
        assert response.status_code == 200, response.text
        response = client.post("/v1/classify", json={"images": [base64.b64encode(p).decode() for p in pngs[5:8]]})
        assert response.status_code == 200, response.text
        assert client.post("/v1/generate", json={"prompt": ""}).status_code == 422  # counted as bad_input

    classify_count = 'sum(tserve_request_duration_seconds_count{job="tserve", endpoint="/v1/classify"})'
    # Labelled series appear with their first observation, and rate() needs a sample before the increase: one
    # round creates every series, the second (after a scrape has seen them) is what rate() and the quantiles see.
    with httpx.Client(base_url=service.url, timeout=60) as client:
        send_traffic(client)
        wait_for("first round scraped", lambda: value(classify_count) == 2, 30)
        send_traffic(client)
    wait_for("second round scraped", lambda: value(classify_count) == 4, 30)
    time.sleep(2)  # one more scrape and rule evaluation

    counts = {r["metric"]["endpoint"]: float(r["value"][1]) for r in
              query('sum by (endpoint) (tserve_request_duration_seconds_count{job="tserve"})')}
    assert counts["/v1/translate"] == 16 and counts["/v1/generate"] == 16 and counts["/v1/classify"] == 4, counts
    assert value('sum(tserve_images_total{job="tserve"})') == 16
    assert value('sum(tserve_generated_tokens_total{job="tserve", model="gpt"})') > 0
    assert value('sum(tserve_request_failures_total{job="tserve", reason="bad_input"})') == 2
    assert value('sum(increase(tserve_images_total{job="tserve"}[1m]))') > 0
    assert value('tserve_ready{job="tserve"}') == 1
    p95 = {r["metric"]["endpoint"]: float(r["value"][1]) for r in query(
        'histogram_quantile(0.95, sum by (endpoint, le) (rate(tserve_request_duration_seconds_bucket'
        '{job="tserve", endpoint=~"/v1/.*", status="200"}[1m])))')}
    assert set(p95) == {"/v1/translate", "/v1/generate", "/v1/classify"}
    assert all(0 < seconds < 120 for seconds in p95.values()), p95
    ttft = value('histogram_quantile(0.5, sum by (le) (rate(tserve_time_to_first_token_seconds_bucket'
                 '{job="tserve", model="gpt"}[1m])))')
    assert 0 < ttft < 60, ttft

    # every query of the dashboard is valid PromQL for this Prometheus and has data after this traffic
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "tserve.json").read_text())
    targets = [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]
    empty = [f"{title}: {expr}" for title, expr in targets if not query(grafana_to_promql(expr))]
    # panels that stay empty after this traffic: no request waited in a queue at the moment of a scrape
    assert all(re.search(r"tserve_queue_depth|tserve_running_requests|tserve_request_failures_total\{[^}]*reason=~",
                         line) for line in empty), "\n".join(empty)

    # every alert rule evaluates without error, and none fires for a healthy replica
    def rules_evaluated():
        groups = api.get("/api/v1/rules").json()["data"]["groups"]
        rules = [rule for group in groups for rule in group["rules"]]
        return rules if rules and all(not r["lastEvaluation"].startswith("0001") for r in rules) else None

    rules = wait_for("alert rules evaluated", rules_evaluated, 30)
    assert {r["name"] for r in rules} >= {"TserveReplicaDown", "TserveHighErrorRate", "TserveHighLatencyP95"}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    alerts = api.get("/api/v1/alerts").json()["data"]["alerts"]
    assert not [a for a in alerts if a["state"] == "firing"
                or a["labels"]["alertname"].startswith(("TserveReplica", "TserveNoReplica"))], alerts

    # the replica dies: up -> 0 and TserveReplicaDown goes pending (it fires after its `for: 1m`)
    service.kill()
    wait_for("up == 0 after the kill", lambda: value('up{job="tserve"}') == 0, 30)

    def pending(*names: str) -> dict[str, dict]:
        alerts = api.get("/api/v1/alerts").json()["data"]["alerts"]
        return {a["labels"]["alertname"]: a for a in alerts if a["state"] == "pending"
                and a["labels"]["alertname"] in names}

    alert = wait_for("TserveReplicaDown pending", lambda: pending("TserveReplicaDown"), 30)["TserveReplicaDown"]
    assert alert["labels"]["instance"] == f"127.0.0.1:{service.port}" and alert["labels"]["severity"] == "critical"

    # the dead replica leaves discovery: no `up` series is left for TserveReplicaDown, the ready count still alerts
    discover([])
    wait_for("the target gone from discovery", lambda: not query('up{job="tserve"}'), 30)
    missing = ("TserveReplicasMissing", "TserveNoReplicaReady")
    alerts = wait_for("the replica alerts pending", lambda: (found := pending(*missing)).keys() == set(missing)
                      and not pending("TserveReplicaDown") and found, 30)
    assert alerts["TserveReplicasMissing"]["annotations"]["summary"] == "tserve replicas ready: 0 of the 1 expected"
    assert alerts["TserveNoReplicaReady"]["labels"]["severity"] == "critical"
    api.close()


# --- nginx in front of two replicas -----------------------------------------------------------------------------


def test_nginx_spreads_load_and_survives_a_killed_replica(tiny_repository, tmp_path, processes, inputs):
    nginx = require_tool("nginx")
    sentences, pngs = inputs
    replicas = [Service(f"replica-{i}", tiny_repository, tmp_path) for i in range(2)]
    processes.extend(replicas)
    port = free_port()
    conf = render_nginx_conf(tmp_path, f"127.0.0.1:{port}", [f"127.0.0.1:{r.port}" for r in replicas])
    processes.append(Process("nginx", [nginx, "-e", "stderr", "-p", str(tmp_path), "-c", str(conf),
                                       "-g", "daemon off;"], tmp_path))
    for replica in replicas:
        replica.wait_ready()
    url = f"http://127.0.0.1:{port}"
    wait_for("nginx up", lambda: httpx.get(f"{url}/health/ready", timeout=5).status_code == 200, 30,
             processes[-1].popen)

    requests = [
        ("POST", "/v1/translate", {"json": {"text": sentences[0], "num_beams": 1, "max_new_tokens": 16}}),
        ("POST", "/v1/translate", {"json": {"text": sentences[1], "num_beams": 3, "max_new_tokens": 16}}),
        ("POST", "/v1/generate", {"json": {"prompt": "KING:", "max_new_tokens": 16, "seed": 1}}),
        ("POST", "/v1/classify", {"files": [("files", ("0.png", pngs[0], "image/png"))]}),
        ("GET", "/v1/models", {}),
    ]
    results: list[tuple[float, str, int, str]] = []  # (time, path, status or -1, error)
    lock = threading.Lock()
    stop = threading.Event()
    duration = 14.0

    def client_loop(worker: int):
        with httpx.Client(base_url=url, timeout=60) as client:
            i = worker
            while not stop.is_set():
                method, path, kwargs = requests[i % len(requests)]
                i += 1
                try:
                    response = client.request(method, path, **kwargs)
                    outcome = (time.monotonic(), path, response.status_code,
                               "" if response.status_code == 200 else response.text[:300])
                except httpx.HTTPError as error:
                    outcome = (time.monotonic(), path, -1, repr(error))
                with lock:
                    results.append(outcome)

    workers = [threading.Thread(target=client_loop, args=(w,), daemon=True) for w in range(4)]
    started = time.monotonic()
    for worker in workers:
        worker.start()
    time.sleep(duration / 3)
    with lock:
        before_kill = len(results)
    killed_at = time.monotonic()
    replicas[0].kill()  # SIGKILL mid-run, requests in flight
    time.sleep(duration - (time.monotonic() - started))
    stop.set()
    for worker in workers:
        worker.join(90)
    assert not any(worker.is_alive() for worker in workers), "a client thread hung"

    after_kill = [r for r in results if r[0] > killed_at]
    assert before_kill >= 10 and len(after_kill) >= 10, (before_kill, len(after_kill))
    # The one loss no proxy can hide: a response the killed replica had begun (nginx already passed its headers
    # on) when SIGKILL landed between its header and body writes. At most one per client thread, only at the
    # kill; every other request, and every request after the kill, must succeed (nginx retries the rest).
    cut_mid_response = [r for r in results if r[2] == -1 and "without sending complete message body" in r[3]
                        and r[0] - killed_at < 2.0]
    failed = [r for r in results if r[2] != 200 and r not in cut_mid_response]
    assert len(cut_mid_response) <= len(workers), cut_mid_response
    assert not failed, f"{len(failed)} of {len(results)} requests failed at the client: {failed[:5]}"

    # nginx's access log says which replica answered: both did before the kill, and requests that met the
    # dead replica were passed on to the live one
    log = [json.loads(line) for line in (tmp_path / "access.log").read_text().splitlines()]
    dead, live = f"127.0.0.1:{replicas[0].port}", f"127.0.0.1:{replicas[1].port}"
    proxied = [entry for entry in log if entry["uri"] != "/health/ready"]
    served_by = {entry["upstream"].split(", ")[-1] for entry in proxied if entry["status"] == 200}
    assert served_by == {dead, live}, served_by
    retried = [entry for entry in proxied if dead in entry["upstream"] and ", " in entry["upstream"]]
    assert retried, "no request was retried on the live replica after the kill"
    assert all(entry["status"] == 200 and entry["upstream"].endswith(live) for entry in retried), retried
    assert all(entry["status"] == 200 for entry in proxied)
    print(f"{len(results)} requests, {len(after_kill)} after the kill, {len(retried)} retried on {live}")
