"""The compose stack for real: docker-compose.yml with docker-compose.test.yml, brought up by docker-compose (1.29)
against a Docker daemon, from the images `make images` builds (deploy/images.sh) with no image registry:

- two api replicas (tserve:cpu, the committed release models of model_repository/), nginx and Prometheus (Debian's
  packages on the same Debian base, running deploy/nginx/nginx.conf and deploy/prometheus/); Grafana is left out
  by the override (no image here; its provisioning is checked as files by tests/deploy/test_deploy.py);
- through nginx's published port on 127.0.0.1: translate, generate (plain and streamed) and classify answer with
  the release models, /health/ready and /metrics answer; Prometheus has both replicas as up targets; through
  nginx's published gRPC port (grpc_pass), `tritonclient.grpc` translates and generates as REST does;
- the image: no torch, a non-root user, and its HEALTHCHECK (the one compose runs) turns healthy;
- a replica stopped as `docker-compose stop` stops one (SIGTERM, then the stop_grace_period) under a short
  bounded load: no accepted request is lost, nginx passes them to the other replica.

The stack is a project of its own (a random name, ports chosen free on 127.0.0.1, never 8000/9090) and is always
torn down (`docker-compose down -v`), even when a test fails. All traffic goes to 127.0.0.1 and the stack's own
containers, bounded in count and time.

Without a Docker daemon (or without the images) the module is skipped with one line saying what to do, as the
other tool-dependent tests are skipped (tests/support/deploy.py, require_tool, which also checks docker-compose
here); with TSERVE_REQUIRE_TOOLS=1 (.ci/run) they fail instead.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from models.data import load_fashion_mnist
from service.client.processes import free_port
from service.client.sse import parse_sse
from tests.support.deploy import require_tool, wait_for
from tests.support.docker import API_IMAGE, docker_api, image
from tests.support.docker import docker_problem as images_problem
from tests.support.images import png_bytes
from tests.support import ROOT

pytestmark = pytest.mark.slow

COMPOSE_FILES = ("docker-compose.yml", "docker-compose.test.yml")
# the names deploy/images.sh gives them (API_IMAGE: tests/support/docker.py)
TEST_IMAGES = {"TSERVE_TEST_NGINX_IMAGE": "tserve-nginx:test", "TSERVE_TEST_PROMETHEUS_IMAGE": "tserve-prometheus:test",
               "TSERVE_TEST_REDIS_IMAGE": "tserve-redis:test"}
REPLICAS = 2
# the api's health check: start_period 300 s (docker-compose.yml), then 3 failures 10 s apart before "unhealthy";
# healthy 10-20 s after start on an AMD EPYC, ~2 minutes on an Intel Xeon (2 cores: two replicas calibrating)
HEALTHY_TIMEOUT_S = 360


def required() -> bool:
    """TSERVE_REQUIRE_TOOLS set (.ci/run): what a test needs must be there, a skip would be a failure."""
    return os.environ.get("TSERVE_REQUIRE_TOOLS", "") not in ("", "0")


def docker_problem() -> str | None:
    """Why the stack cannot run here (no Docker daemon, or the images not built), in one line; None if it can."""
    return images_problem((API_IMAGE, *TEST_IMAGES.values()))


# Without Docker, the whole module is skipped with one line (a developer's machine), as require_tool skips a test
# whose tool is missing; with TSERVE_REQUIRE_TOOLS set (.ci/run) it is not skipped: the stack fixture fails every
# test with that line instead.
if (_PROBLEM := docker_problem()) and not required():
    pytest.skip(_PROBLEM, allow_module_level=True)


@dataclass
class Stack:
    compose: str
    project: str
    env: dict[str, str]
    docker: httpx.Client
    url: str = ""
    grpc_address: str = ""  # nginx's published gRPC port, host:port
    prometheus_url: str = ""
    seconds_to_healthy: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)

    def run(self, *args: str, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess:
        files = [f for name in COMPOSE_FILES for f in ("-f", name)]
        command = [self.compose, "--ansi", "never", "-p", self.project, *files, *args]
        result = subprocess.run(command, check=False, cwd=ROOT, env=self.env, capture_output=True, text=True,
                                timeout=timeout, stdin=subprocess.DEVNULL)
        if check:
            assert result.returncode == 0, (f"{' '.join(args)} exited {result.returncode}\n"
                                            f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
        return result

    def containers(self, service: str) -> list[dict]:
        """`docker inspect` of the service's containers (stopped ones too), by replica number."""
        labels = [f"com.docker.compose.project={self.project}", f"com.docker.compose.service={service}"]
        listed = self.docker.get("/containers/json", params={"all": "1", "filters": json.dumps({"label": labels})})
        listed.raise_for_status()
        found = [self.docker.get(f"/containers/{c['Id']}/json").json() for c in listed.json()]
        return sorted(found, key=lambda c: int(c["Config"]["Labels"]["com.docker.compose.container-number"]))

    def address(self, container: dict) -> str:
        (network,) = container["NetworkSettings"]["Networks"].values()
        return network["IPAddress"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    compose = require_tool("docker-compose")
    if problem := docker_problem():
        if required():
            pytest.fail(f"{problem}; TSERVE_REQUIRE_TOOLS is set (.ci/run), so this is a failure", pytrace=False)
        pytest.skip(problem)  # the daemon went away since collection
    docker, _ = docker_api()

    # the shell's TSERVE_* and COMPOSE_* variables and an .env file must not change the stack under test
    env_file = tmp_path_factory.mktemp("compose") / "empty.env"
    env_file.touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TSERVE_", "COMPOSE_", "GRAFANA_"))}
    env.update(TEST_IMAGES, TSERVE_IMAGE=API_IMAGE, TSERVE_REPLICAS=str(REPLICAS),
               TSERVE_INTRA_OP_THREADS="1")  # two replicas on a shared 2-core machine
    stack = Stack(compose, f"tservetest{secrets.token_hex(4)}", env, docker)
    try:
        for attempt in range(3):  # a free port can be taken before Docker binds it: new ports, once more
            nginx_port, grpc_port, prometheus_port = free_port(), free_port(), free_port()
            env.update(TSERVE_BIND_ADDRESS="127.0.0.1", TSERVE_PUBLIC_PORT=str(nginx_port),
                       TSERVE_GRPC_PUBLIC_PORT=str(grpc_port), TSERVE_PROMETHEUS_PORT=str(prometheus_port))
            started = time.monotonic()
            result = stack.run("--env-file", str(env_file), "up", "-d", "--no-build", check=False)
            taken = "address already in use" in result.stderr or "port is already allocated" in result.stderr
            if result.returncode == 0 or not taken or attempt == 2:
                break
            stack.run("down", "-v", "--remove-orphans", "-t", "5", check=False)
        assert result.returncode == 0, f"up exited {result.returncode}\n{result.stdout}\n{result.stderr}"
        stack.timings["up"] = time.monotonic() - started
        stack.url = f"http://127.0.0.1:{nginx_port}"
        stack.grpc_address = f"127.0.0.1:{grpc_port}"
        stack.prometheus_url = f"http://127.0.0.1:{prometheus_port}"

        def all_healthy():
            replicas = stack.containers("api")
            assert len(replicas) == REPLICAS, [c["Name"] for c in replicas]
            states = [c["State"] for c in replicas]
            bad = [c["Name"] for c in replicas if c["State"]["Status"] != "running"
                   or c["State"]["Health"]["Status"] == "unhealthy"]
            assert not bad, f"replicas not running or unhealthy: {bad}"
            return all(s["Health"]["Status"] == "healthy" for s in states)

        wait_for("both api replicas healthy", all_healthy, HEALTHY_TIMEOUT_S)
        stack.seconds_to_healthy = time.monotonic() - started
        with httpx.Client(timeout=5, trust_env=False) as client:
            wait_for("nginx answers /health/ready", lambda: client.get(f"{stack.url}/health/ready").status_code
                     == 200, 60)
            wait_for("Prometheus ready", lambda: client.get(f"{stack.prometheus_url}/-/ready").status_code == 200, 60)
        print(f"docker-compose up -d: {stack.timings['up']:.1f} s; both replicas healthy "
              f"{stack.seconds_to_healthy:.1f} s after it started")
        yield stack
    finally:
        try:  # shown by pytest when a test failed
            logs = stack.run("logs", "--no-color", "--tail=40", timeout=60, check=False).stdout
        except subprocess.TimeoutExpired as error:
            logs = repr(error)
        print(f"----- docker-compose logs (last 40 lines per container) -----\n{logs[-30000:]}")
        down = stack.run("down", "-v", "--remove-orphans", "-t", "15", timeout=180, check=False)
        left = stack.docker.get("/containers/json", params={"all": "1", "filters": json.dumps(
            {"label": [f"com.docker.compose.project={stack.project}"]})}).json()
        docker.close()
        assert down.returncode == 0 and not left, f"down -v: {down.returncode}\n{down.stderr}\nleft: {left}"


@pytest.fixture(scope="module")
def client(stack):
    with httpx.Client(base_url=stack.url, timeout=60, trust_env=False) as client:
        yield client


@pytest.fixture(scope="module")
def pngs(data_dir):
    images, labels = load_fashion_mnist(data_dir, "test")
    return [png_bytes(array) for array in images[:16]], [int(label) for label in labels[:16]]


# --- the image --------------------------------------------------------------------------------------------------


def test_the_image_has_no_torch_runs_as_non_root_and_turns_healthy(stack):
    config = image(stack.docker, API_IMAGE)
    user = config["Config"]["User"]
    assert user and user.split(":")[0] not in ("", "0", "root"), user
    healthcheck = config["Config"]["Healthcheck"]["Test"]
    assert "/health/ready" in " ".join(healthcheck)
    for replica in stack.containers("api"):
        assert replica["Config"]["Image"] == API_IMAGE
        assert replica["Config"]["Healthcheck"]["Test"] == healthcheck  # compose runs the image's own check
        assert replica["State"]["Health"]["Status"] == "healthy"
    probe = ("import importlib.util, os; "
             "print(os.getuid(), os.getgid(), importlib.util.find_spec('torch') is None, "
             "importlib.util.find_spec('onnxruntime') is not None)")
    for index in range(1, REPLICAS + 1):
        result = stack.run("exec", "-T", "--index", str(index), "api", "python", "-c", probe, timeout=60)
        assert result.stdout.split() == ["10001", "10001", "True", "True"], result.stdout
    sizes = {name: image(stack.docker, name)["Size"] / 1e6 for name in (API_IMAGE, *TEST_IMAGES.values())}
    print("image sizes: " + ", ".join(f"{name} {size:.0f} MB" for name, size in sizes.items()))


# --- through nginx ----------------------------------------------------------------------------------------------


def test_translate_generate_and_classify_through_nginx(client, pngs):
    ready = client.get("/health/ready")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert sorted(models) == ["gpt", "translation", "vit"] and all(m["ready"] for m in models.values())

    answer = client.post("/v1/translate", json={"text": "Zwei Hunde spielen im Schnee.", "num_beams": 4})
    assert answer.status_code == 200, answer.text
    assert answer.json()["translations"][0][0]["text"] == "Two dogs play in the snow."

    payload = {"prompt": "ROMEO:\n", "max_new_tokens": 40, "temperature": 0}
    plain = client.post("/v1/generate", json=payload)
    assert plain.status_code == 200, plain.text
    text = plain.json()["text"]
    assert len(text.split()) >= 4, text
    with client.stream("POST", "/v1/generate", json={**payload, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = parse_sse(response.read())
    assert "".join(event["token"] for event in events) == text  # greedy: the same text, streamed through nginx

    images, labels = pngs
    files = [("files", (f"{i}.png", png, "image/png")) for i, png in enumerate(images)]
    response = client.post("/v1/classify", files=files, data={"top_k": "1"})
    assert response.status_code == 200, response.text
    predictions = response.json()["predictions"]
    correct = sum(p[0]["index"] == label for p, label in zip(predictions, labels))
    assert len(predictions) == len(images) and correct >= 13, (correct, len(images))  # 92% on the test set

    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert "tserve_request_duration_seconds_bucket" in metrics.text and "tserve_ready" in metrics.text


def test_grpc_inference_through_nginx(stack, client):
    import numpy as np
    import tritonclient.grpc as tgrpc

    grpc_client = tgrpc.InferenceServerClient(stack.grpc_address)
    try:
        assert grpc_client.is_server_ready() and grpc_client.is_model_ready("translation")
        text = tgrpc.InferInput("TEXT", [1], "BYTES")
        text.set_data_from_numpy(np.array(["Zwei Hunde spielen im Schnee.".encode()], dtype=object))
        result = grpc_client.infer("translation", [text], parameters={"num_beams": 4})
        assert result.as_numpy("TRANSLATION")[0].decode() == "Two dogs play in the snow."
        prompt = tgrpc.InferInput("PROMPT", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([b"ROMEO:\n"], dtype=object))
        greedy = {"max_new_tokens": 40, "temperature": 0}
        generated = grpc_client.infer("gpt", [prompt], parameters=greedy).as_numpy("TEXT")[0].decode()
        assert generated == client.post("/v1/generate", json={"prompt": "ROMEO:\n", **greedy}).json()["text"]
    finally:
        grpc_client.close()


# --- Prometheus -------------------------------------------------------------------------------------------------


def test_prometheus_scrapes_both_replicas(stack):
    expected = {f"{stack.address(c)}:8000" for c in stack.containers("api")}
    assert len(expected) == REPLICAS

    with httpx.Client(base_url=stack.prometheus_url, timeout=10, trust_env=False) as prometheus:
        def both_up():
            targets = prometheus.get("/api/v1/targets").json()["data"]["activeTargets"]
            tserve = {t["labels"]["instance"]: t["health"] for t in targets if t["labels"]["job"] == "tserve"}
            return tserve if tserve == dict.fromkeys(expected, "up") else None

        def ready_values() -> dict[str, float]:
            query = prometheus.get("/api/v1/query", params={"query": 'tserve_ready{job="tserve"}'}).json()
            return {r["metric"]["instance"]: float(r["value"][1]) for r in query["data"]["result"]}

        wait_for(f"Prometheus targets {sorted(expected)} up", both_up, 60)
        # the replicas are ready (the stack waited for it), but a scrape may predate it: a replica that was scraped
        # while it was still loading reads 0 until its next scrape (every 5 s, deploy/prometheus/prometheus.yml)
        wait_for("tserve_ready 1 on both replicas in Prometheus",
                 lambda: ready_values() == dict.fromkeys(expected, 1.0), 30)
        assert ready_values() == dict.fromkeys(expected, 1.0), ready_values()


# --- fail-over --------------------------------------------------------------------------------------------------


def test_stopping_a_replica_loses_no_accepted_request(stack, pngs):
    """One replica is stopped the way `docker-compose stop` stops each container (SIGTERM, SIGKILL only after the
    service's stop_grace_period, 45 s) under 3 clients, each sending a request every 50 ms or slower, for about
    15 s (at most 1,000 requests); every request must succeed."""
    images, _ = pngs
    requests = [  # (path, httpx arguments, streamed)
        ("/v1/translate", {"json": {"text": "Ein Mann fährt Fahrrad.", "num_beams": 1, "max_new_tokens": 16}}, False),
        ("/v1/generate", {"json": {"prompt": "KING:", "max_new_tokens": 16, "seed": 1}}, False),
        ("/v1/classify", {"files": [("files", ("0.png", images[0], "image/png"))]}, False),
        ("/v1/generate", {"json": {"prompt": "KING:", "max_new_tokens": 16, "seed": 2, "stream": True}}, True),
    ]
    results: list[tuple[float, str, int, str]] = []  # (time, path, status or -1, error)
    lock = threading.Lock()
    stop = threading.Event()
    max_requests = 1000  # a bound, whatever the speed

    def client_loop(worker: int):
        with httpx.Client(base_url=stack.url, timeout=60, trust_env=False) as client:
            i = worker
            while not stop.is_set() and len(results) < max_requests:
                path, kwargs, streamed = requests[i % len(requests)]
                i += 1
                try:
                    if streamed:
                        with client.stream("POST", path, **kwargs) as response:
                            body = response.read()
                        error = "" if response.status_code == 200 and parse_sse(body) else body[:300].decode()
                    else:
                        response = client.post(path, **kwargs)
                        error = "" if response.status_code == 200 else response.text[:300]
                    outcome = (time.monotonic(), path, response.status_code, error)
                except Exception as error:  # noqa: BLE001 - a transport error or a cut stream: a lost request
                    outcome = (time.monotonic(), path, -1, repr(error))
                with lock:
                    results.append(outcome)
                stop.wait(0.05)

    first, second = stack.containers("api")
    workers = [threading.Thread(target=client_loop, args=(w,), daemon=True) for w in range(3)]
    for worker in workers:
        worker.start()
    time.sleep(4)
    stop_started = time.monotonic()
    # what `docker-compose stop` does to each container of a service, to this one replica only
    stopped = stack.docker.post(f"/containers/{second['Id']}/stop", params={"t": "45"}, timeout=90)
    stop_done = time.monotonic()
    time.sleep(4)
    stop.set()
    for worker in workers:
        worker.join(90)
    assert not any(worker.is_alive() for worker in workers), "a client thread hung"
    assert stopped.status_code == 204, stopped.text

    failed = [r for r in results if r[2] != 200 or r[3]]
    before = [r for r in results if r[0] < stop_started]
    during = [r for r in results if stop_started <= r[0] < stop_done]
    after = [r for r in results if r[0] >= stop_done]
    print(f"{len(results)} requests: {len(before)} before the stop, {len(during)} while the replica drained "
          f"({stop_done - stop_started:.1f} s), {len(after)} after it; {len(failed)} failed")
    assert len(before) >= 5 and len(after) >= 5, (len(before), len(after))
    assert not failed, f"{len(failed)} of {len(results)} requests failed at the client: {failed[:5]}"

    state = stack.docker.get(f"/containers/{second['Id']}/json").json()["State"]
    assert not state["Running"] and state["ExitCode"] == 0, state  # drained and exited by itself, not killed
    assert stack.docker.get(f"/containers/{first['Id']}/json").json()["State"]["Health"]["Status"] == "healthy"

    # nginx's access log (in the order the responses ended): both replicas answered, and the requests sent after
    # the stop (less one in flight per client) all by the live one
    log = stack.run("logs", "--no-color", "nginx", timeout=60).stdout
    entries = [json.loads(line.split("| ", 1)[1]) for line in log.splitlines() if '| {"time"' in line]
    proxied = [e for e in entries if e["uri"].startswith("/v1/")]
    assert all(e["status"] == 200 for e in proxied), "nginx answered an error"
    live, dead = f"{stack.address(first)}:8000", f"{stack.address(second)}:8000"
    assert {e["upstream"].split(", ")[-1] for e in proxied} == {live, dead}
    last = proxied[-(len(after) - len(workers)):]
    assert all(e["upstream"].split(", ")[-1] == live for e in last), [e["upstream"] for e in last]
    retried = [e for e in proxied if ", " in e["upstream"]]
    print(f"nginx: {len(retried)} requests passed on to another replica after an error")
