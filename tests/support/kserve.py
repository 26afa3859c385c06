"""KServe for the tests: the runtime's manifests (deploy/kserve/: the ServingRuntime, its ClusterServingRuntime twin,
the InferenceServices) and what KServe makes of them, and the real KServe Python SDK, run in its own venv (`make
kserve-venv`, which `make test` builds; requirements/kserve.in says why): tests/api/kserve_sdk_client.py sends each
case through the SDK's `InferenceRESTClient` (an http:// base URL) or `InferenceGRPCClient` (grpc://HOST:PORT) and
prints the answers as one JSON line. Used by tests/deploy/test_kserve.py, tests/deploy/test_kserve_image.py,
tests/api/test_kserve_model_dir.py and tests/api/test_oip_api.py.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.support import ROOT

KSERVE = ROOT / "deploy" / "kserve"
KSERVE_PYTHON = ROOT / ".venv-kserve" / "bin" / "python"
KSERVE_CLIENT = ROOT / "tests" / "api" / "kserve_sdk_client.py"
KSERVE_TIMEOUT_S = 300  # the SDK's import and a few dozen inferences on a busy 2-core machine
GRPC_SCHEME = "grpc://"  # the client script's address for the gRPC client (kserve_sdk_client.GRPC_SCHEME)
NAME_PLACEHOLDER = "{{.Name}}"  # KServe templates the runtime's container with the InferenceService's metadata
MODEL_DIR = "/mnt/models"  # where KServe's storage initializer leaves the storageUri's contents
# the runtime's port names as KServe reads them: the first is the InferenceService's HTTP port; a name holding h2c
# gets appProtocol kubernetes.io/h2c (gRPC)
HTTP_PORT_NAME, GRPC_PORT_NAME = "http1", "h2c"


def load(path: Path) -> list[dict]:
    """The documents of a YAML file."""
    return [document for document in yaml.safe_load_all(path.read_text()) if document]


MANIFESTS = {path.name: load(path) for path in sorted(KSERVE.glob("*.yaml"))}
(RUNTIME,) = MANIFESTS["servingruntime.yaml"]
(CLUSTER_RUNTIME,) = MANIFESTS["clusterservingruntime.yaml"]
SERVICES = MANIFESTS["inferenceservices.yaml"]
CONTAINER = RUNTIME["spec"]["containers"][0]  # the predictor container (kserve-container)
ENV = {variable["name"]: variable["value"] for variable in CONTAINER["env"]}


def runtime_args(service_name: str) -> list[str]:
    """The runtime container's args as KServe passes them for an InferenceService of that name."""
    return [arg.replace(NAME_PLACEHOLDER, service_name) for arg in CONTAINER["args"]]


def kserve_infer(address: str, cases: list[dict], folder: Path) -> list[dict]:
    """Each case through the KServe SDK's client for `address` (http://HOST:PORT, or grpc://HOST:PORT): its response
    (id, model_name, outputs by name) or its error (status, error). The case file is written in `folder`."""
    if not KSERVE_PYTHON.exists():
        pytest.skip(f"the KServe SDK's venv {KSERVE_PYTHON.parent.parent} is missing: run `make kserve-venv`")
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=folder, delete=False) as cases_file:
        json.dump(cases, cases_file)
    done = subprocess.run([str(KSERVE_PYTHON), str(KSERVE_CLIENT), address, cases_file.name], capture_output=True,
                          text=True, timeout=KSERVE_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)
