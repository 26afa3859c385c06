"""The deployment files are valid and agree with the service: Prometheus config and alert rules (promtool, with
unit tests of the alerts; every alert's runbook_url an anchor of docs/deployment.md's runbooks), docker-compose.yml
(docker-compose config; published ports on loopback unless TSERVE_BIND_ADDRESS says otherwise), the nginx config
(nginx -t), the Dockerfiles and .dockerignore, the Kubernetes manifests (kubernetes-validate, offline schemas), the
Grafana dashboard (its "Replicas ready" stat red below the expected count), and no drift: every metric a dashboard
or alert query names is exported by a live service or recorded by a rule, and every TSERVE_* variable the
deployment sets is a setting of service/settings.py.

A missing system tool (promtool, docker-compose, nginx) skips its test on a developer's machine, with one line
naming the tool and the Debian package that installs it (`tests.support.deploy.require_tool`); only with
TSERVE_REQUIRE_TOOLS=1 in the environment, which .ci/run sets, does it fail the test instead, so CI cannot pass by
skipping (deploy/ci-packages.txt lists what .ci/run installs). kubernetes-validate, a Python package of the `dev`
extra, fails the test when it is missing, everywhere.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest
import yaml

from service.client.launcher import ServiceProcess
from service.settings import Settings
from tests.support.deploy import TOOLS, render_nginx_conf, require_tool
from tests.support.markdown import sections
from tests.support import ROOT

pytestmark = pytest.mark.slow

DEPLOY = ROOT / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
RULE_FILES = ("alerts.yml", "replicas.yml")  # prometheus.yml's rule_files
RUNBOOKS = ROOT / "docs" / "deployment.md"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "tserve.json"
K8S = DEPLOY / "k8s"
# tools .ci/run installs (Debian packages; deploy/ci-packages.txt)
# Prometheus' own series that rules may use besides the service's
PROMETHEUS_BUILTINS = {"up", "ALERTS", "ALERTS_FOR_STATE", "scrape_duration_seconds", "scrape_samples_scraped"}
K8S_VERSIONS = ("1.29.0", None)  # the oldest supported Kubernetes we target, and the newest schemas shipped




def run(command: list[str], cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (f"{' '.join(command)} exited {result.returncode}\n"
                                    f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


# --- PromQL: the metric names a query uses ---------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.$])([a-zA-Z_:][\w:]*)\b(?!\s*\()")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless",
             "inf", "nan", "Inf", "NaN"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers outside strings, label matchers, grouping clauses and
    ranges that are not function calls or keywords."""
    expr = _STRING.sub('""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = _GROUPING.sub("", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    return {name for name in _IDENTIFIER.findall(expr) if name not in _KEYWORDS}


def test_promql_metric_names():
    expr = ('histogram_quantile(0.95, sum by (le, endpoint) (rate(tserve_request_duration_seconds_bucket'
            '{job="tserve", endpoint=~"/v1/.*", instance=~"$instance"}[$__rate_interval]))) / on (job) '
            'group_left sum without (reason) (increase(tserve_images_total[5m] offset 1m)) > 1e3 and up == 0')
    assert promql_metric_names(expr) == {"tserve_request_duration_seconds_bucket", "tserve_images_total", "up"}


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = []

    def walk(panels):
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    return exprs


def dashboard_variable_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    names = set()
    for variable in dashboard["templating"]["list"]:
        query = variable.get("definition") or variable.get("query", {}).get("query", "")
        match = re.match(r"\s*label_values\(\s*([a-zA-Z_:][\w:]*)", query)
        if match:
            names.add(match.group(1))
    return names


def rules() -> list[dict]:
    """Every rule of the rule files Prometheus loads, alerting and recording."""
    return [rule for name in RULE_FILES for group in yaml.safe_load((PROMETHEUS_DIR / name).read_text())["groups"]
            for rule in group["rules"]]


def rule_exprs() -> list[str]:
    return [rule["expr"] for rule in rules()]


def recorded_names() -> set[str]:
    """The series the recording rules make (tserve:replicas_expected): not the service's, but there to query."""
    return {rule["record"] for rule in rules() if "record" in rule}


ALERTS = [rule for rule in rules() if "alert" in rule]


def rule_test_series() -> set[str]:
    tests = yaml.safe_load((PROMETHEUS_DIR / "alerts.test.yml").read_text())
    return {re.match(r"[a-zA-Z_:][\w:]*", series["series"]).group(0)
            for case in tests["tests"] for series in case["input_series"]}


def exported_names(metrics_text: str) -> set[str]:
    """Every series name the exposition allows: sample names seen, plus each family's suffixes by type."""
    names = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
            elif kind == "summary":
                names |= {f"{name}_sum", f"{name}_count", f"{name}_created"}
            elif kind == "counter":
                base = name.removesuffix("_total")
                names |= {f"{base}_total", f"{base}_created"}
        elif line and not line.startswith("#"):
            names.add(re.match(r"[a-zA-Z_:][\w:]*", line).group(0))
    return names


# --- Prometheus -------------------------------------------------------------------------------------------------


def test_ci_packages_list_every_tool():
    packages = {line.strip() for line in (DEPLOY / "ci-packages.txt").read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    assert set(TOOLS.values()) <= packages


def test_prometheus_config_and_alert_rules():
    promtool = require_tool("promtool")
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    assert tuple(config["rule_files"]) == RULE_FILES
    run([promtool, "check", "config", "prometheus.yml"], cwd=PROMETHEUS_DIR)
    run([promtool, "check", "rules", *RULE_FILES], cwd=PROMETHEUS_DIR)
    result = run([promtool, "test", "rules", "alerts.test.yml"], cwd=PROMETHEUS_DIR)
    assert "SUCCESS" in result.stdout
    # every alert has a unit test
    tested = {t["alertname"] for case in yaml.safe_load((PROMETHEUS_DIR / "alerts.test.yml").read_text())["tests"]
              for t in case.get("alert_rule_test", [])}
    alerts = {r["alert"] for r in ALERTS}
    assert alerts == tested, f"alerts without a unit test: {sorted(alerts - tested)}"
    assert {"TserveReplicasMissing", "TserveNoReplicaReady"} <= alerts, "a replica that leaves discovery must alert"


@pytest.mark.parametrize("alert", ALERTS, ids=[rule["alert"] for rule in ALERTS])
def test_every_alert_has_a_runbook(alert):
    """runbook_url is `docs/deployment.md#<anchor>` and that document has the heading, whose entry names the alert and
    says what it means, what to check and what to do."""
    url = alert["annotations"].get("runbook_url", "")
    assert re.fullmatch(r"docs/deployment\.md#[\w-]+", url), f"{alert['alert']}: runbook_url {url!r} is not a runbook"
    anchor = url.partition("#")[2]
    entries = sections(RUNBOOKS)
    assert anchor in entries, f"{alert['alert']}: docs/deployment.md has no heading with the anchor #{anchor}"
    entry = entries[anchor]
    assert alert["alert"] in entry or alert["alert"].lower() in anchor
    for part in ("Means", "Check", "Do"):
        assert re.search(rf"\*\*{part}\b", entry), f"docs/deployment.md#{anchor}: no **{part}** part in the runbook"


def test_prometheus_scrapes_every_replica_directly():
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "tserve")
    assert job["dns_sd_configs"][0]["names"] == ["api"] and job["dns_sd_configs"][0]["port"] == 8000


# --- docker-compose ---------------------------------------------------------------------------------------------


def _compose_config(*profile: str, env: dict[str, str] | None = None) -> dict:
    """`docker-compose config` of docker-compose.yml, with the shell's TSERVE_* variables and any .env file left
    out (then `env` added), so that the defaults are what is checked."""
    compose = require_tool("docker-compose")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TSERVE_", "COMPOSE_"))}
    with tempfile.TemporaryDirectory() as folder:
        empty = Path(folder) / "empty.env"  # docker-compose v1 wants a file, not /dev/null
        empty.touch()
        command = [compose, "--env-file", str(empty), "-f", str(ROOT / "docker-compose.yml"), *profile, "config"]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60,
                                env={**clean, **(env or {})})
    assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}\n{result.stderr}"
    return yaml.safe_load(result.stdout)


def _published(port) -> tuple[str, str, str]:
    """(host address, host port, container port) of a `docker-compose config` port: v1 prints
    "127.0.0.1:8000:80/tcp", v2 a mapping with host_ip, published and target."""
    if isinstance(port, dict):
        return str(port.get("host_ip", "")), str(port.get("published", "")), str(port["target"])
    host, _, container = str(port).rpartition(":")
    address, _, published = host.rpartition(":")
    return address, published, container.split("/")[0]


@pytest.mark.parametrize("env, address, ports", [
    ({}, "127.0.0.1", {"nginx": ["8000", "8001"], "prometheus": ["9090"], "grafana": ["3000"],
                       "locust-master": ["8089"]}),
    ({"TSERVE_BIND_ADDRESS": "0.0.0.0"}, "0.0.0.0",
     {"nginx": ["8000", "8001"], "prometheus": ["9090"], "grafana": ["3000"], "locust-master": ["8089"]}),
    ({"TSERVE_PUBLIC_PORT": "18000", "TSERVE_GRPC_PUBLIC_PORT": "18001", "TSERVE_PROMETHEUS_PORT": "19090",
      "TSERVE_GRAFANA_PORT": "13000", "TSERVE_LOCUST_PORT": "18089"}, "127.0.0.1",
     {"nginx": ["18000", "18001"], "prometheus": ["19090"], "grafana": ["13000"], "locust-master": ["18089"]}),
], ids=["default-loopback", "bind-all-interfaces", "other-ports"])
def test_compose_publishes_ports_on_loopback_unless_told(env, address, ports):
    """Every published port of every profile binds to TSERVE_BIND_ADDRESS, 127.0.0.1 by default: a stack
    started on a shared host is not reachable from the network until the operator says so."""
    services = _compose_config("--profile", "load", "--profile", "gpu", env=env)["services"]
    published = {name: [_published(p) for p in service.get("ports", [])] for name, service in services.items()}
    assert {name for name, found in published.items() if found} == set(ports), published
    for name, expected in ports.items():
        assert [(a, p) for a, p, _ in published[name]] == [(address, port) for port in expected], (name, published)


def test_compose_config():
    config = _compose_config()
    services = config["services"]
    assert {"api", "nginx", "prometheus", "grafana"} <= set(services)
    gpu = _compose_config("--profile", "gpu")["services"]["api-gpu"]
    assert gpu["profiles"] == ["gpu"], "GPU replicas start only with --profile gpu"
    assert all("profiles" not in services[name] for name in ("api", "nginx", "prometheus", "grafana"))
    assert gpu["build"]["dockerfile"] == "deploy/Dockerfile.gpu"
    assert gpu["environment"]["TSERVE_DEVICE"] == "cuda"
    assert "api" in gpu["networks"]["default"]["aliases"]  # same DNS name: nginx/Prometheus find it
    assert gpu["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]

    load = _compose_config("--profile", "load")["services"]
    assert load["locust-master"]["profiles"] == ["load"] and load["locust-worker"]["profiles"] == ["load"]
    assert "--master" in load["locust-master"]["command"] and "--worker" in load["locust-worker"]["command"]
    assert [_published(p)[2] for p in load["locust-master"]["ports"]] == ["8089"]
    assert (ROOT / "deploy" / "Dockerfile.locust").is_file()

    tserve = services["api"]
    assert any("/srv/model_repository" in str(v) for v in tserve["volumes"]), "the model repository is mounted"
    assert (ROOT / tserve["build"]["context"] / tserve["build"]["dockerfile"]).is_file()
    assert "ports" not in tserve, "replicas must not publish a host port (nginx does), or they cannot scale"
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if source.startswith(str(ROOT)):  # what the checkout provides (the data folder is the operator's)
                assert Path(source).exists(), f"compose mounts {source}, which does not exist"
    fields = set(Settings.model_fields)
    for name in ("api", "api-gpu"):
        service = services.get(name) or gpu
        for key in service["environment"]:
            assert key.startswith("TSERVE_") and key[7:].lower() in fields, f"{name}: {key} is not a setting"
    # the response cache: off unless TSERVE_RESPONSE_CACHE says, every replica on the stack's one Redis, bounded
    assert not tserve["environment"]["TSERVE_RESPONSE_CACHE"] and "ports" not in services["redis"]
    assert tserve["environment"]["TSERVE_RESPONSE_CACHE_REDIS_URL"] == "redis://redis:6379/0" == \
        gpu["environment"]["TSERVE_RESPONSE_CACHE_REDIS_URL"]
    redis = " ".join(services["redis"]["command"])
    assert "--maxmemory 128mb --maxmemory-policy allkeys-lru" in redis and "--save " in redis
    grace = float(str(tserve["stop_grace_period"]).rstrip("s"))
    env = tserve["environment"]
    assert grace > float(env["TSERVE_DRAIN_DELAY_S"]) + float(env["TSERVE_DRAIN_TIMEOUT_S"])


# --- nginx ------------------------------------------------------------------------------------------------------


def test_nginx_config(tmp_path):
    nginx = require_tool("nginx")
    conf = render_nginx_conf(tmp_path, "127.0.0.1:18080", ["127.0.0.1:18001", "127.0.0.1:18002"])
    run([nginx, "-t", "-e", "stderr", "-p", str(tmp_path), "-c", str(conf), "-g", "daemon off;"])
    text = (DEPLOY / "nginx" / "nginx.conf").read_text()
    retry = re.search(r"proxy_next_upstream ([^;]*);", text).group(1).split()
    assert {"error", "timeout", "http_502", "http_503", "non_idempotent"} <= set(retry)
    assert not re.search(r"^\s*daemon ", text, flags=re.M), "the nginx image passes `daemon off;` itself"
    max_body = Settings.model_fields["max_body_bytes"].default
    size = re.search(r"client_max_body_size (\d+)m;", text).group(1)
    assert int(size) * 1_000_000 >= max_body


# --- Docker images ----------------------------------------------------------------------------------------------


def _dockerignore_allows(path: str) -> bool:
    """.dockerignore semantics for the patterns we use: later lines win; `!x/` re-includes x and what is under it."""
    allowed = True
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        if pattern == "*" or path == pattern or path.startswith(pattern + "/"):
            allowed = negate
    return allowed


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile(dockerfile):
    text = (DEPLOY / dockerfile).read_text()
    instructions = [line.strip() for line in re.sub(r"\\\n", " ", text).splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    copies = [i.split()[1:-1] for i in instructions if i.startswith("COPY") and "--from=" not in i]
    for sources in copies:
        for source in (s for s in sources if not s.startswith("--")):
            assert (ROOT / source).exists() or source == "model_repository/", f"{dockerfile}: COPY {source}: missing"
            assert _dockerignore_allows(source.rstrip("/")), f"{dockerfile}: .dockerignore excludes {source}"
    for excluded in (".venv", "runs", ".git", "reports", ".cache", "tests"):
        assert not _dockerignore_allows(excluded), f".dockerignore lets {excluded} into the build context"
    code = " ".join(instructions).replace("find_spec('torch')", "")
    assert "[train]" not in code and "torch" not in code, "the serving image must not install torch"
    user = [i for i in instructions if i.startswith("USER")]
    assert user and not user[-1].split()[1].startswith(("0", "root")), "the server must not run as root"
    assert any(i.startswith("HEALTHCHECK") and "/health/ready" in i for i in instructions)
    assert instructions[-1] == 'ENTRYPOINT ["python", "-m", "service"]'
    env = dict(re.findall(r"\b(TSERVE_\w+)=(\S+)", " ".join(i for i in instructions if i.startswith("ENV"))))
    assert env["TSERVE_HOST"] == "0.0.0.0" and env["TSERVE_PORT"] == "8000"
    fields = set(Settings.model_fields)
    assert all(key[7:].lower() in fields for key in env), f"not settings: {[k for k in env if k[7:].lower() not in fields]}"
    assert "EXPOSE 8000 8001" in instructions and env["TSERVE_GRPC_PORT"] == "8001"


def test_locust_image_has_the_project_modules_the_locustfile_imports():
    """deploy/Dockerfile.locust copies modules, not the package: each project module the locustfile imports (and
    they import, at their top level) must be copied, with its package's __init__.py, and let in by .dockerignore."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile.locust").read_text())
    packages = ("models", "service", "export")
    copied = {source for line in text.splitlines() if line.startswith("COPY") and "--from=" not in line
              for source in line.split()[1:-1]}
    for source in copied:
        assert (ROOT / source).exists(), f"Dockerfile.locust: COPY {source}: missing"
        assert _dockerignore_allows(source.rstrip("/")), f".dockerignore excludes {source} (Dockerfile.locust)"

    def project_imports(path: Path) -> set[str]:
        modules = set()
        for node in ast.parse(path.read_text()).body:  # top level, and try/except ImportError fallbacks
            branches = [*node.body, *(s for h in node.handlers for s in h.body)] if isinstance(node, ast.Try) else []
            for statement in [node, *branches]:
                if isinstance(statement, ast.ImportFrom) and (statement.module or "").split(".")[0] in packages:
                    modules.add(statement.module)
        return modules

    todo, seen = project_imports(DEPLOY / "locust" / "locustfile.py"), set()
    assert "service.client.sse" in todo
    while todo:
        module = todo.pop()
        seen.add(module)
        parts = module.split(".")
        packages_of = ["/".join(parts[:depth]) for depth in range(1, len(parts))]
        source = "/".join(parts) + ".py"
        for needed in [f"{package}/__init__.py" for package in packages_of] + [source]:
            assert needed in copied or any(f"{package}/" in copied for package in packages_of), \
                f"Dockerfile.locust does not copy {needed}"
        todo |= project_imports(ROOT / source) - seen


# --- Kubernetes -------------------------------------------------------------------------------------------------


def _k8s_resources() -> dict[str, dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    resources = {}
    for name in kustomization["resources"]:
        path = K8S / name
        assert path.is_file(), f"kustomization.yaml lists {name}, which does not exist"
        for document in yaml.safe_load_all(path.read_text()):
            resources[document["kind"]] = document
    return resources


def test_kubernetes_manifests_validate():
    try:
        import kubernetes_validate
        from kubernetes_validate.utils import ValidationError
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: it belongs to the `dev` extra (pip install -e '.[dev]')")
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    for version in K8S_VERSIONS:
        version = version or kubernetes_validate.latest_version()
        for name in kustomization["resources"]:
            for document in yaml.safe_load_all((K8S / name).read_text()):
                try:
                    kubernetes_validate.validate(document, version, strict=True)
                except ValidationError as error:
                    pytest.fail(f"{name} ({document['kind']}) against Kubernetes {version}: {error.message} at "
                                f"{'.'.join(map(str, error.path))}")


def test_kubernetes_manifests_agree():
    r = _k8s_resources()
    deployment, config = r["Deployment"], r["ConfigMap"]["data"]
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert r["Service"]["spec"]["selector"].items() <= labels.items()
    assert r["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    target = r["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert r["HorizontalPodAutoscaler"]["spec"]["minReplicas"] > r["PodDisruptionBudget"]["spec"]["minAvailable"]

    container = pod["spec"]["containers"][0]
    assert container["envFrom"][0]["configMapRef"]["name"] == r["ConfigMap"]["metadata"]["name"]
    fields = set(Settings.model_fields)
    assert all(key.startswith("TSERVE_") and key[7:].lower() in fields for key in config), "unknown setting"
    Settings(**{key[7:].lower(): value for key, value in config.items()})  # every value parses
    port = next(p for p in container["ports"] if p["name"] == "http")
    assert port["containerPort"] == int(config["TSERVE_PORT"]) and config["TSERVE_HOST"] == "0.0.0.0"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert int(config["TSERVE_INTRA_OP_THREADS"]) <= float(container["resources"]["limits"]["cpu"])
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = float(pre_stop[1]) + float(config["TSERVE_DRAIN_DELAY_S"]) + float(config["TSERVE_DRAIN_TIMEOUT_S"])
    assert pod["spec"]["terminationGracePeriodSeconds"] > drain
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == config["TSERVE_PORT"]
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


# --- Grafana ----------------------------------------------------------------------------------------------------


def test_grafana_provisioning_and_dashboard():
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/tserve.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "tserve"
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == uid, panel["title"]
            assert panel["targets"], panel["title"]
    exprs = "\n".join(dashboard_exprs())
    for quantile in ("0.5", "0.95", "0.99"):
        assert re.search(rf"histogram_quantile\({quantile}, sum by \(endpoint, le\) \(rate\("
                         r"tserve_request_duration_seconds_bucket", exprs), f"p{quantile} latency per endpoint"
    for needed in ("tserve_time_to_first_token_seconds_bucket", "tserve_generated_tokens_total",
                   "tserve_images_total", "tserve_batch_size_", "tserve_queue_depth", "tserve_request_failures_total"):
        assert needed in exprs, f"the dashboard has no panel on {needed}"


def test_replicas_ready_stat_is_red_below_the_expected_count():
    """The "Replicas ready" stat's green threshold is the expected count (tserve:replicas_expected, the recording
    rule TserveReplicasMissing uses), taken from a second query by Grafana's "Config from query results"; below
    it the stat is red, and with no replica at all it shows 0 (red), not "No data"."""
    dashboard = json.loads(DASHBOARD.read_text())
    panel = next(p for p in dashboard["panels"] if p["title"] == "Replicas ready")
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["color"] for s in steps] == ["red", "green"] and steps[0]["value"] is None, steps
    targets = {t["refId"]: t for t in panel["targets"]}
    (transformation,) = [t for t in panel.get("transformations", []) if t["id"] == "configFromData"]
    config = targets[transformation["options"]["configRefId"]]
    assert promql_metric_names(config["expr"]) == {"tserve:replicas_expected"} <= recorded_names()
    assert config["instant"] and config.get("format") == "table"  # one row: its "Value" field is the threshold
    assert transformation["options"]["mappings"] == [{"fieldName": "Value", "handlerKey": "threshold1"}]
    (shown,) = [t for ref, t in targets.items() if ref != config["refId"]]
    assert "tserve_ready" in shown["expr"] and "or vector(0)" in shown["expr"]


# --- drift: every metric the dashboard and the alerts use exists in a live /metrics ------------------------------




def test_dashboard_and_alerts_use_only_exported_metrics(tiny_repository, tmp_path):
    service = ServiceProcess("service", tiny_repository, tmp_path, ready_timeout=180, intra_op_threads=1,
                             calibration_cache="")
    try:
        with service, httpx.Client(base_url=service.url, timeout=30) as client:
            # one request of each kind, so every labelled family has samples too
            assert client.post("/v1/translate", json={"text": "Ein Hund läuft.", "num_beams": 2}).status_code == 200
            assert client.post("/v1/generate", json={"prompt": "ROMEO:", "max_new_tokens": 8}).status_code == 200
            assert client.post("/v1/generate", json={"prompt": "x", "max_new_tokens": 9999}).status_code == 422
            metrics = client.get("/metrics").text
    except BaseException:
        print(service.output())
        raise

    exported = exported_names(metrics)
    assert "tserve_request_duration_seconds_bucket" in exported and "tserve_images_total" in exported
    used = {}
    for where, exprs in (("dashboard", dashboard_exprs()), ("alerts.yml", rule_exprs())):
        for expr in exprs:
            for name in promql_metric_names(expr):
                used.setdefault(name, set()).add(where)
    for name in dashboard_variable_metrics():
        used.setdefault(name, set()).add("dashboard variable")
    for name in rule_test_series():
        used.setdefault(name, set()).add("alerts.test.yml")
    assert len(used) >= 10
    missing = {name: sorted(where) for name, where in used.items()
               if name not in exported and name not in PROMETHEUS_BUILTINS | recorded_names()}
    assert not missing, f"queries use metrics the service does not export: {missing}"
