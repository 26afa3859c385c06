"""The GPU deployment agrees with the locked onnxruntime-gpu: deploy/Dockerfile.gpu's CUDA and cuDNN majors are the
ones the wheel needs, the lock holds the NVIDIA wheels that provide them, and the Kubernetes GPU overlay
(deploy/k8s-gpu) asks for a GPU and validates.

What the wheel needs is read from the locked wheel itself: PyPI's index names the file whose sha256 is the lock's,
and its METADATA (the `cuda` and `cudnn` extras' Requires-Dist) is read with a few HTTP range requests, not the 250 MB
download. The file is the one the lock pins (PyPI's files are immutable and the index maps the hash to its URL),
so a lock moved to a wheel built for another CUDA major fails here. Without PyPI the test is skipped, or fails under
CI (TSERVE_REQUIRE_TOOLS=1). That the libraries resolve inside the built image: `make gpu-image-check`.
"""

from __future__ import annotations

import email.parser
import hashlib
import io
import re
import zipfile
from dataclasses import dataclass

import httpx
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from service.settings import Settings
from tests.support.locks import GPU_TARGET, read_lock
from tests.support import ROOT
from tests.support.skips import REQUIRE_ENV, required

LOCK = ROOT / "requirements" / "serving-gpu.txt"
DOCKERFILE = ROOT / "deploy" / "Dockerfile.gpu"
K8S = ROOT / "deploy" / "k8s"
K8S_GPU = ROOT / "deploy" / "k8s-gpu"
WHEEL = "onnxruntime-gpu"
INDEX = f"https://pypi.org/simple/{WHEEL}/"
INDEX_JSON = "application/vnd.pypi.simple.v1+json"  # PEP 691
# the image's wheel: the lock's Python (Makefile LOCK_GPU) on x86-64 Linux
IMAGE_TAG = "cp{0}-cp{0}-manylinux_".format(GPU_TARGET["python_version"].replace(".", ""))
TAIL_BYTES = 256 * 1024  # a wheel's zip directory, read first (this one's is ~60 kB)
READAHEAD_BYTES = 64 * 1024  # a member's local header and its compressed METADATA in one request
TIMEOUT_S = 30
CUDA_RUNTIME = re.compile(r"nvidia-cuda-runtime(?:-cu(\d+))?")  # CUDA 13's wheels dropped the -cuNN suffix
CUDNN = re.compile(r"nvidia-cudnn-cu(\d+)")
NVIDIA_CUDA_IMAGE = re.compile(r"nvidia/cuda:(\d+)\.\d+\.\d+-cudnn-runtime")
LOWER_BOUNDS = ("~=", "==", "===", ">=")  # the specifier operators that say which major a requirement is for
K8S_VERSIONS = ("1.29.0", None)  # as tests/deploy/test_deploy.py: the oldest we target, the newest schemas


@dataclass(frozen=True)
class CudaNeeds:
    cuda: int  # the CUDA major (nvidia-cuda-runtime's)
    cudnn: int  # the cuDNN major
    requirements: tuple[Requirement, ...]  # every Requires-Dist of the `cuda` and `cudnn` extras


def major(requirement: Requirement) -> int:
    """The major version a requirement's lower bounds and pins name (`~=13.0`, `>=13,<14`, `==13.0.96` -> 13); one,
    or an error."""
    majors = {Version(spec.version).major for spec in requirement.specifier if spec.operator in LOWER_BOUNDS}
    assert len(majors) == 1, f"{requirement}: not one major version"
    return majors.pop()


def cuda_needs(metadata: str) -> CudaNeeds:
    """The CUDA and cuDNN majors a wheel's METADATA asks for in its `cuda` and `cudnn` extras."""
    message = email.parser.Parser().parsestr(metadata, headersonly=True)
    extras = {extra: [r for r in map(Requirement, message.get_all("Requires-Dist") or [])
                      if r.marker is not None and r.marker.evaluate({**GPU_TARGET, "extra": extra})]
              for extra in ("cuda", "cudnn")}
    runtime = [r for r in extras["cuda"] if CUDA_RUNTIME.fullmatch(canonicalize_name(r.name))]
    cudnn = [r for r in extras["cudnn"] if CUDNN.fullmatch(canonicalize_name(r.name))]
    assert len(runtime) == 1 and len(cudnn) == 1, f"no CUDA runtime or cuDNN in the cuda/cudnn extras: {extras}"
    cuda = major(runtime[0])
    for requirement in (*runtime, *cudnn):  # a -cuNN suffix names the CUDA major too
        name = canonicalize_name(requirement.name)
        match = CUDA_RUNTIME.fullmatch(name) or CUDNN.fullmatch(name)
        suffix = match.group(1) if match else None
        assert suffix is None or int(suffix) == cuda, f"{requirement} is for CUDA {suffix}, the runtime for {cuda}"
    return CudaNeeds(cuda, major(cudnn[0]), tuple(extras["cuda"] + extras["cudnn"]))


@dataclass(frozen=True)
class DockerfileProvides:
    cuda: int  # ARG CUDA_MAJOR
    cudnn: int  # ARG CUDNN_MAJOR
    cuda_images: tuple[int, ...]  # the CUDA majors of the nvidia/cuda images it names


def dockerfile_provides(text: str) -> DockerfileProvides:
    args = dict(re.findall(r"^ARG (CUDA_MAJOR|CUDNN_MAJOR)=(\d+)$", text, flags=re.M))
    assert set(args) == {"CUDA_MAJOR", "CUDNN_MAJOR"}, f"Dockerfile.gpu: ARG CUDA_MAJOR / CUDNN_MAJOR missing: {args}"
    images = tuple(int(m) for m in NVIDIA_CUDA_IMAGE.findall(text))
    return DockerfileProvides(int(args["CUDA_MAJOR"]), int(args["CUDNN_MAJOR"]), images)


def mismatches(needs: CudaNeeds, provides: DockerfileProvides) -> list[str]:
    found = []
    if needs.cuda != provides.cuda:
        found.append(f"the wheel needs CUDA {needs.cuda}, Dockerfile.gpu's CUDA_MAJOR is {provides.cuda}")
    if needs.cudnn != provides.cudnn:
        found.append(f"the wheel needs cuDNN {needs.cudnn}, Dockerfile.gpu's CUDNN_MAJOR is {provides.cudnn}")
    found += [f"Dockerfile.gpu names nvidia/cuda:{m}.x, the wheel needs CUDA {needs.cuda}"
              for m in provides.cuda_images if m != needs.cuda]
    return found


# --- reading the locked wheel's METADATA from PyPI ---------------------------------------------------------------


class RemoteFile(io.RawIOBase):
    """A seekable, read-only view of a file on an HTTP server that answers Range requests, fetched in blocks: enough
    for zipfile to read a wheel's directory and one small member."""

    def __init__(self, client: httpx.Client, url: str):
        super().__init__()
        self.client, self.url, self.position = client, url, 0
        self.blocks: dict[int, bytes] = {}
        response = self._get(f"bytes=-{TAIL_BYTES}")
        self.size = int(response.headers["content-range"].rpartition("/")[2])
        self.blocks[self.size - len(response.content)] = response.content

    def _get(self, byte_range: str) -> httpx.Response:
        response = self.client.get(self.url, headers={"Range": byte_range})
        assert response.status_code == 206, f"{self.url}: {response.status_code} to a Range request"
        return response

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.position = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence] + offset
        return self.position

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), self.size - self.position))
        data = next((block[self.position - start:self.position - start + count]
                     for start, block in self.blocks.items()
                     if start <= self.position and self.position + count <= start + len(block)), None)
        if data is None and count:
            end = min(self.size, self.position + max(count, READAHEAD_BYTES))
            self.blocks[self.position] = self._get(f"bytes={self.position}-{end - 1}").content
            data = self.blocks[self.position][:count]
        buffer[:count] = data or b""
        self.position += count
        return count


def locked_wheel_metadata() -> tuple[str, str]:
    """(file name, METADATA) of the image's onnxruntime-gpu wheel: the one of PyPI's files whose sha256 the lock
    holds. PEP 658's metadata file when the index offers it (checked against its hash), else read from the wheel."""
    entry = read_lock(LOCK)[WHEEL]
    try:
        with httpx.Client(timeout=TIMEOUT_S, follow_redirects=True) as client:
            response = client.get(INDEX, headers={"Accept": INDEX_JSON})
            response.raise_for_status()
            files = [f for f in response.json()["files"] if f["hashes"].get("sha256") in entry.hashes
                     and IMAGE_TAG in f["filename"] and f["filename"].endswith("_x86_64.whl")]
            assert len(files) == 1, f"{WHEEL}=={entry.version}: {len(files)} locked {IMAGE_TAG}*x86_64 wheels on PyPI"
            (wheel,) = files
            assert wheel["filename"].startswith(f"onnxruntime_gpu-{entry.version}-"), wheel["filename"]
            core = wheel.get("core-metadata") or wheel.get("dist-info-metadata")
            if isinstance(core, dict) and core.get("sha256"):
                response = client.get(wheel["url"] + ".metadata")
                response.raise_for_status()
                data = response.content
                assert hashlib.sha256(data).hexdigest() == core["sha256"], f"{wheel['url']}.metadata: not the index's"
                return wheel["filename"], data.decode()
            with zipfile.ZipFile(RemoteFile(client, wheel["url"])) as archive:
                (name,) = [n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
                return wheel["filename"], archive.read(name).decode()  # zipfile checks the member's CRC
    except httpx.TransportError as error:
        message = f"PyPI unreachable ({INDEX}: {error!r}): the locked wheel's metadata cannot be read"
        if required():
            pytest.fail(f"{message}; {REQUIRE_ENV} is set (.ci/run)", pytrace=False)
        pytest.skip(message)


# --- the tests ---------------------------------------------------------------------------------------------------

CUDA13 = """Metadata-Version: 2.4
Name: onnxruntime-gpu
Requires-Dist: numpy>=1.21.6
Requires-Dist: nvidia-cuda-nvrtc~=13.0; extra == "cuda"
Requires-Dist: nvidia-cuda-runtime~=13.0; extra == "cuda"
Requires-Dist: nvidia-cufft~=12.0; extra == "cuda"
Requires-Dist: nvidia-cudnn-cu13~=9.0; extra == "cudnn"
"""
CUDA12 = """Metadata-Version: 2.1
Name: onnxruntime-gpu
Requires-Dist: nvidia-cuda-runtime-cu12~=12.0; extra == "cuda"
Requires-Dist: nvidia-cublas-cu12~=12.0; extra == "cuda"
Requires-Dist: nvidia-cudnn-cu12~=9.0; extra == "cudnn"
"""
DOCKERFILE_13 = "ARG CUDA_MAJOR=13\nARG CUDNN_MAJOR=9\n# or nvidia/cuda:13.0.2-cudnn-runtime-ubuntu24.04\n"


@pytest.mark.parametrize(("metadata", "dockerfile", "problems"), [
    (CUDA13, DOCKERFILE_13, []),
    (CUDA12, DOCKERFILE_13, ["the wheel needs CUDA 12, Dockerfile.gpu's CUDA_MAJOR is 13",
                             "Dockerfile.gpu names nvidia/cuda:13.x, the wheel needs CUDA 12"]),
    (CUDA13.replace("cudnn-cu13~=9.0", "cudnn-cu13~=10.0"), DOCKERFILE_13,
     ["the wheel needs cuDNN 10, Dockerfile.gpu's CUDNN_MAJOR is 9"]),
    (CUDA13.replace("runtime~=13.0", "runtime>=13.0,<14"), DOCKERFILE_13, []),
    (CUDA13, DOCKERFILE_13.replace("cuda:13.0.2", "cuda:12.6.3"),
     ["Dockerfile.gpu names nvidia/cuda:12.x, the wheel needs CUDA 13"]),
], ids=["agree", "wheel-for-cuda-12", "wheel-for-cudnn-10", "a-range-of-one-major", "names-a-cuda-12-image"])
def test_a_mismatch_between_wheel_and_dockerfile_is_found(metadata, dockerfile, problems):
    assert mismatches(cuda_needs(metadata), dockerfile_provides(dockerfile)) == problems


def test_cuda_needs_refuses_metadata_without_the_extras():
    with pytest.raises(AssertionError, match="no CUDA runtime or cuDNN"):
        cuda_needs("Metadata-Version: 2.1\nName: onnxruntime-gpu\nRequires-Dist: numpy\n")
    with pytest.raises(AssertionError, match="is for CUDA 12"):
        cuda_needs(CUDA13.replace("nvidia-cudnn-cu13", "nvidia-cudnn-cu12"))


def test_dockerfile_points_the_loader_at_the_cuda_major_it_declares():
    """The ld.so.conf entry names nvidia/cu${CUDA_MAJOR}/lib (CUDA 13's wheels put every library there) and the
    CUDA_WHEELS=0 path drops exactly the lock's nvidia-* entries."""
    text = DOCKERFILE.read_text()
    assert "site-packages/nvidia/cu${CUDA_MAJOR}/lib" in text and "site-packages/nvidia/cudnn/lib" in text
    assert "ldconfig" in text and "/^nvidia-/" in text


@pytest.mark.slow
def test_the_locked_wheel_needs_the_cuda_the_image_provides():
    """The image's wheel, read from PyPI by the lock's hash, asks for the CUDA and cuDNN majors of Dockerfile.gpu
    (and of every nvidia/cuda image it names), and the lock holds each of its cuda/cudnn extras' requirements at a
    version the requirement allows (the image installs them: its CUDA and cuDNN)."""
    filename, metadata = locked_wheel_metadata()
    needs = cuda_needs(metadata)
    problems = mismatches(needs, dockerfile_provides(DOCKERFILE.read_text()))
    assert not problems, f"{filename} (requirements/serving-gpu.txt): {'; '.join(problems)}"
    locked = read_lock(LOCK)
    for requirement in needs.requirements:
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{filename} needs {requirement}, which serving-gpu.txt lacks (requirements/gpu.in)"
        assert requirement.specifier.contains(locked[name].version), f"{name}=={locked[name].version}: {requirement}"


# --- the Kubernetes GPU overlay ----------------------------------------------------------------------------------


def strategic_merge(base, patch):
    """Kustomize's strategic merge for what the overlay patches: maps merge, lists of named items merge by name,
    anything else is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{key: strategic_merge(base.get(key), value) for key, value in patch.items()}}
    named = isinstance(base, list) and isinstance(patch, list) and all(
        isinstance(item, dict) and "name" in item for item in base + patch)
    if named:
        patches = {item["name"]: item for item in patch}
        merged = [strategic_merge(item, patches.pop(item["name"])) if item["name"] in patches else item
                  for item in base]
        return merged + list(patches.values())
    return patch


def render_gpu_overlay() -> dict[str, dict]:
    """deploy/k8s-gpu applied to deploy/k8s: {kind: resource}, with the overlay's image tag."""
    overlay = yaml.safe_load((K8S_GPU / "kustomization.yaml").read_text())
    assert overlay["resources"] == ["../k8s"], "the overlay builds on deploy/k8s and nothing else"
    base = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    resources = {doc["kind"]: doc for name in base["resources"]
                 for doc in yaml.safe_load_all((K8S / name).read_text())}
    for entry in overlay["patches"]:
        patch = yaml.safe_load((K8S_GPU / entry["path"]).read_text())
        target = resources[patch["kind"]]
        assert target["metadata"]["name"] == patch["metadata"]["name"], f"{entry['path']} patches no base resource"
        resources[patch["kind"]] = strategic_merge(target, patch)
    (image,) = overlay["images"]
    for container in resources["Deployment"]["spec"]["template"]["spec"]["containers"]:
        if container["image"].partition(":")[0] == image["name"]:
            container["image"] = f"{image['newName']}:{image['newTag']}"
    return resources


def test_kubernetes_gpu_overlay_asks_for_a_gpu_and_validates():
    import kubernetes_validate
    from kubernetes_validate.utils import ValidationError

    listed = {entry["path"] for entry in yaml.safe_load((K8S_GPU / "kustomization.yaml").read_text())["patches"]}
    assert listed == {p.name for p in K8S_GPU.glob("*.yaml")} - {"kustomization.yaml"}
    resources = render_gpu_overlay()
    pod = resources["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "tserve:gpu", "the overlay runs the CUDA image (deploy/Dockerfile.gpu)"
    assert str(container["resources"]["limits"]["nvidia.com/gpu"]) == "1", "one GPU per pod"
    assert "nvidia.com/gpu" not in container["resources"]["requests"] or \
        container["resources"]["requests"]["nvidia.com/gpu"] == container["resources"]["limits"]["nvidia.com/gpu"]
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])), "no toleration for GPU nodes"
    config = resources["ConfigMap"]["data"]
    assert config["TSERVE_DEVICE"] == "cuda"
    fields = set(Settings.model_fields)
    assert all(key.startswith("TSERVE_") and key[7:].lower() in fields for key in config), config
    for version in K8S_VERSIONS:
        version = version or kubernetes_validate.latest_version()
        for kind in ("Deployment", "ConfigMap"):
            try:
                kubernetes_validate.validate(resources[kind], version, strict=True)
            except ValidationError as error:
                pytest.fail(f"deploy/k8s-gpu's {kind} against Kubernetes {version}: {error.message} at "
                            f"{'.'.join(map(str, error.path))}")
