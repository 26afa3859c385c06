"""The KServe runtime for real, on the image `make images` builds (tserve:cpu): deploy/kserve/servingruntime.yaml's
container started for each InferenceService of deploy/kserve/inferenceservices.yaml as KServe starts it (its args
with {{.Name}} the InferenceService's name, its environment, user, read-only root filesystem with /tmp writable,
dropped capabilities and resource limits), with the release model's folder of model_repository/ mounted read-only
at /mnt/models, as the storage initializer leaves the storageUri's contents. The three models at once, a container
each. Against each, the KServe SDK's REST client (on the port named http1) and gRPC client (on the port named h2c)
infer, agree with each other and with what the model is known to answer (a translation, a greedy continuation,
Fashion-MNIST labels), and a request for another name is refused; each container then stops as a pod's does
(SIGTERM, the drain) and exits 0.

Without a Docker daemon or the image the module is skipped with one line (tests/support/docker.py); under CI
(TSERVE_REQUIRE_TOOLS=1; .ci/run builds the images first) it fails instead. Bounded: three containers, a few dozen
inferences, one to two minutes on 2 cores, most of it the models' loading and weights-variant timing.
"""

from __future__ import annotations

import base64
import os
import secrets
import struct
import time
from dataclasses import dataclass

import httpx
import pytest

from models.data import FASHION_MNIST_LABELS, load_fashion_mnist
from service.client.processes import LOOPBACK
from tests.support import ROOT
from tests.support.deploy import wait_for
from tests.support.docker import API_IMAGE, docker_api, docker_problem
from tests.support.images import png_bytes
from tests.support.kserve import (CONTAINER, ENV, GRPC_PORT_NAME, GRPC_SCHEME, HTTP_PORT_NAME, MODEL_DIR, SERVICES,
                                  kserve_infer, runtime_args)
from tests.support.skips import required

pytestmark = pytest.mark.slow

RELEASE = ROOT / "model_repository"
READY_TIMEOUT_S = 300  # three models loading and timing their weights variants at once on 2 busy cores
LOG_LINES = 40  # of each container's output, printed when a test fails
LOG_FRAME_HEADER = 8  # bytes: the stream (1), padding (3), the frame's size (4, big-endian)
TEST_LABEL = "tserve.test"  # on the containers the module starts: this run's name
BINARY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}  # the memory limit's suffixes
PORTS = {port["name"]: port["containerPort"] for port in CONTAINER["ports"]}
GRACE_S = max(service["spec"]["predictor"]["terminationGracePeriodSeconds"] for service in SERVICES)
IMAGES, MIN_CORRECT = 16, 13  # Fashion-MNIST test images classified; the release ViT gets 93% of the test set
GERMAN, ENGLISH = "Zwei Hunde spielen im Schnee.", "Two dogs play in the snow."  # the release translator's beam 4

if (_PROBLEM := docker_problem((API_IMAGE,))) and not required():
    pytest.skip(_PROBLEM, allow_module_level=True)


@dataclass
class Runtime:
    name: str  # the InferenceService's, which the model is served under
    id: str
    http: str = ""  # the REST base URL (the port named http1)
    grpc: str = ""  # the gRPC address (the port named h2c), grpc://HOST:PORT


def quantity(text: str) -> int:
    """A Kubernetes memory quantity with a binary suffix (`2Gi`), in bytes."""
    unit = text[-2:]
    return int(float(text[:-2]) * BINARY_UNITS[unit]) if unit in BINARY_UNITS else int(text)


def container_config(name: str, label: str) -> dict:
    """Docker's create body for the runtime's container of the InferenceService `name`."""
    security, limits = CONTAINER["securityContext"], CONTAINER["resources"]["limits"]
    published = {f"{port}/tcp": [{"HostIp": LOOPBACK, "HostPort": ""}] for port in PORTS.values()}  # "": any free
    return {
        "Image": API_IMAGE, "Cmd": runtime_args(name), "Env": [f"{key}={value}" for key, value in ENV.items()],
        "User": f"{security['runAsUser']}:{security['runAsGroup']}", "ExposedPorts": dict.fromkeys(published, {}),
        "Labels": {TEST_LABEL: label},
        "HostConfig": {
            "Binds": [f"{RELEASE / name}:{MODEL_DIR}:ro"], "PortBindings": published,
            "ReadonlyRootfs": security["readOnlyRootFilesystem"], "CapDrop": security["capabilities"]["drop"],
            "SecurityOpt": [] if security["allowPrivilegeEscalation"] else ["no-new-privileges"],
            "Tmpfs": {mount["mountPath"]: "" for mount in CONTAINER["volumeMounts"]},
            "NanoCpus": int(min(float(limits["cpu"]), os.cpu_count() or 1) * 1e9),
            "Memory": quantity(limits["memory"]),
        },
    }


def demultiplex(stream: bytes) -> str:
    """A container's logs as the Engine API sends them without a TTY: frames of an 8-byte header (stream, size)."""
    text, at = [], 0
    while at + LOG_FRAME_HEADER <= len(stream):
        (size,) = struct.unpack(">I", stream[at + 4:at + LOG_FRAME_HEADER])
        start = at + LOG_FRAME_HEADER
        text.append(stream[start:start + size].decode("utf-8", "replace"))
        at = start + size
    return "".join(text)


def host_port(info: dict, port: int) -> str:
    return info["NetworkSettings"]["Ports"][f"{port}/tcp"][0]["HostPort"]


@pytest.fixture(scope="module")
def docker():
    if problem := docker_problem((API_IMAGE,)):
        pytest.fail(f"{problem}; TSERVE_REQUIRE_TOOLS is set (.ci/run), so this is a failure", pytrace=False)
    client, _ = docker_api()
    with client:
        yield client


@pytest.fixture(scope="module")
def runtimes(docker) -> dict[str, Runtime]:
    label = f"tservekserve{secrets.token_hex(4)}"
    started: dict[str, Runtime] = {}
    try:
        for service in SERVICES:
            name = service["metadata"]["name"]
            created = docker.post("/containers/create", params={"name": f"{label}-{name}"},
                                  json=container_config(name, label))
            assert created.status_code == 201, created.text
            started[name] = Runtime(name, created.json()["Id"])
            assert docker.post(f"/containers/{started[name].id}/start").status_code == 204
        probe = CONTAINER["readinessProbe"]["httpGet"]
        with httpx.Client(timeout=5, trust_env=False) as client:
            for runtime in started.values():
                info = docker.get(f"/containers/{runtime.id}/json").json()
                runtime.http = f"http://{LOOPBACK}:{host_port(info, PORTS[HTTP_PORT_NAME])}"
                runtime.grpc = f"{GRPC_SCHEME}{LOOPBACK}:{host_port(info, PORTS[GRPC_PORT_NAME])}"

                def ready(runtime=runtime):
                    state = docker.get(f"/containers/{runtime.id}/json").json()["State"]
                    assert state["Running"], f"{runtime.name}: the container exited ({state['ExitCode']})"
                    return client.get(f"{runtime.http}{probe['path']}").status_code == 200

                wait_for(f"{runtime.name}: {probe['path']} answers 200", ready, READY_TIMEOUT_S)
        yield started
    finally:
        for runtime in started.values():
            logs = docker.get(f"/containers/{runtime.id}/logs", params={"stdout": 1, "stderr": 1, "tail": LOG_LINES})
            print(f"----- {runtime.name}: the last {LOG_LINES} lines -----\n{demultiplex(logs.content)}")
            docker.delete(f"/containers/{runtime.id}", params={"force": "1", "v": "1"})


@pytest.fixture(scope="module")
def pngs(data_dir) -> tuple[list[str], list[str]]:
    """Fashion-MNIST test images as base64 PNG files (as the client script takes binary BYTES), and their labels."""
    images, labels = load_fashion_mnist(data_dir, "test")
    return ([base64.b64encode(png_bytes(array)).decode() for array in images[:IMAGES]],
            [FASHION_MNIST_LABELS[int(label)] for label in labels[:IMAGES]])


def cases_for(name: str, pngs) -> tuple[dict, list]:
    """The case the model of InferenceService `name` answers, and what it must answer (None: any)."""
    inputs = {
        "translation": ([{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": [GERMAN]}], {"num_beams": 4},
                        "TRANSLATION", [ENGLISH]),
        "gpt": ([{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": ["ROMEO:\n"]}],
                {"max_new_tokens": 16, "temperature": 0}, "TEXT", None),
        "vit": ([{"name": "IMAGE", "shape": [IMAGES], "datatype": "BYTES", "binary": True, "data": pngs[0]}], None,
                "LABEL", pngs[1]),
    }
    tensors, parameters, output, expected = inputs[name]
    return {"model": name, "id": f"kserve-{name}", "inputs": tensors, "parameters": parameters,
            "outputs": [{"name": output}]}, [output, expected]


@pytest.mark.parametrize("name", [s["metadata"]["name"] for s in SERVICES])
def test_the_kserve_sdks_rest_and_grpc_clients_infer_with_the_runtime(runtimes, pngs, tmp_path, name):
    runtime = runtimes[name]
    assert httpx.get(f"{runtime.http}/v2/models/{name}/ready", trust_env=False).status_code == 200
    case, (output, expected) = cases_for(name, pngs)
    other = {**case, "model": next(n for n in runtimes if n != name), "id": "other"}  # a name this one does not serve
    rest = kserve_infer(runtime.http, [case, other], tmp_path)
    grpc = kserve_infer(runtime.grpc, [case, other], tmp_path)
    for answers, refused in ((rest, 404), (grpc, "NOT_FOUND")):
        answer, unknown = answers
        assert (answer.get("id"), answer.get("model_name")) == (case["id"], name), answer
        assert unknown["status"] == refused, unknown
    data = rest[0]["outputs"][output]["data"]
    assert grpc[0]["outputs"][output]["data"] == data and data, (rest, grpc)
    if name == "vit":
        correct = sum(label == truth for label, truth in zip(data, expected))
        assert len(data) == IMAGES and correct >= MIN_CORRECT, (correct, data)
    elif expected is not None:
        assert data == expected


def test_each_container_stops_as_a_pod_does(runtimes, docker):
    """SIGTERM (Docker's stop, as the kubelet's after preStop), the drain, exit 0, within the grace period."""
    for runtime in runtimes.values():
        started = time.monotonic()
        stopped = docker.post(f"/containers/{runtime.id}/stop", params={"t": str(GRACE_S)}, timeout=GRACE_S + 30)
        assert stopped.status_code == 204, stopped.text
        state = docker.get(f"/containers/{runtime.id}/json").json()["State"]
        assert (state["Running"], state["ExitCode"]) == (False, 0), state
        assert time.monotonic() - started < GRACE_S
