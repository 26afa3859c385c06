"""The offline wheel folder of `make gpu-check`: what a GPU machine with no package index installs from.

`prepare` (`make gpu-wheels`, on a machine with PyPI) downloads, with `pip download --require-hashes`, the wheels
for CPython 3.12 on x86-64 Linux of the serving lock (requirements/serving-gpu.txt, onnxruntime-gpu included) but
for what a CUDA image already has (numpy, `IMAGE_PROVIDES`), plus the few tools the check runs beside the service
(`TOOLS`: pytest, httpx, and onnx for the engine benchmark's export; their versions and hashes from
requirements/dev.txt), then splits the big onnxruntime-gpu wheel into `PART_BYTES` parts named as `split -b 18M`
names them (`<wheel>.part-aa`, `-ab`, ...), so that each fits a transfer. `assemble` (on the GPU machine) puts each
split wheel back together in suffix order, refusing a gap in the suffixes or parts of unequal size, and `verify`
checks every wheel's sha256 against the lock entry of its name and version, naming both hashes on a mismatch.
"""

from __future__ import annotations

import hashlib
import re
import string
import subprocess
import sys
import tempfile
from fnmatch import fnmatch
from itertools import product
from pathlib import Path

from . import PROJECT_ROOT

SERVING_LOCK = PROJECT_ROOT / "requirements" / "serving-gpu.txt"
DEV_LOCK = PROJECT_ROOT / "requirements" / "dev.txt"
LOCKS = (SERVING_LOCK, DEV_LOCK)  # a wheel's hash is looked up in this order
BIG_WHEEL = "onnxruntime-gpu"
PART_BYTES = 18 * 1024 * 1024  # `split -b 18M`: one part per 64 MiB transfer beside the tracked tree (~44 MiB)
PART_MARK = ".part-"
SUFFIX_LETTERS = 2  # split's default suffix length: aa .. zz
# what a CUDA image with PyTorch has already (the check's venv sees it through --system-site-packages), as fnmatch
# patterns: numpy (~17 MB of wheel) and the CUDA libraries' `nvidia-*` wheels (GBs), which the lock may list
IMAGE_PROVIDES = ("numpy", "nvidia-*")
# beside the serving set: the test runner (tests/gpu), the HTTP benchmark's client, and onnx for the engine
# benchmark's export of its random-weight models (torch comes with the image)
TOOLS = ("pytest", "pluggy", "iniconfig", "pygments", "httpx", "httpcore", "onnx", "ml-dtypes")
PYTHON_VERSION = "3.12"
ABI = "cp312"
# the manylinux tags a CUDA 13 image's glibc (2.28 or later) accepts, newest first
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
CHUNK_BYTES = 1024 * 1024
_ENTRY = re.compile(r"^([A-Za-z0-9._-]+)==([^\s\\;]+)")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


class WheelError(Exception):
    """A wheel folder that cannot be installed as it is: a part missing, a hash that is not the lock's."""


def normalize(name: str) -> str:
    """PEP 503: `onnxruntime_gpu`, `ONNXRuntime-GPU` -> `onnxruntime-gpu`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(path: Path) -> dict[str, tuple[str, list[str]]]:
    """A `uv pip compile --generate-hashes` lock -> {normalized name: (version, [sha256, ...])}."""
    entries: dict[str, tuple[str, list[str]]] = {}
    name = None
    for line in path.read_text().splitlines():
        match = _ENTRY.match(line)
        if match:
            name = normalize(match.group(1))
            entries[name] = (match.group(2), [])
        if name is not None:
            entries[name][1].extend(_HASH.findall(line))
        if not line.rstrip().endswith("\\"):
            name = None
    return entries


def wheel_name_version(path: Path) -> tuple[str, str]:
    """`onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_27_x86_64.whl` -> ("onnxruntime-gpu", "1.31.1")."""
    name, version = path.name.split("-")[:2]
    return normalize(name), version


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def locked_hashes(name: str, version: str, locks=None) -> tuple[Path, list[str]]:
    """(the lock that pins `name==version`, its hashes); WheelError when no lock pins that version. `locks`:
    default `LOCKS`."""
    locks = LOCKS if locks is None else locks
    for lock in locks:
        entry = parse_lock(lock).get(name)
        if entry and entry[0] == version:
            return lock, entry[1]
    raise WheelError(f"{name}=={version} is in no lock ({', '.join(str(lock) for lock in locks)})")


def verify(wheel: Path, locks=None) -> str:
    """The wheel's sha256 when it is one its lock lists; WheelError naming both hashes otherwise."""
    name, version = wheel_name_version(wheel)
    lock, hashes = locked_hashes(name, version, locks)
    actual = sha256(wheel)
    if actual not in hashes:
        raise WheelError(f"{wheel.name}: sha256 {actual} is not the lock's: {lock.name} pins {name}=={version} with "
                         f"sha256 {', '.join(hashes)}")
    return actual


def split_suffixes(count: int) -> list[str]:
    """The first `count` suffixes `split` gives its parts: aa, ab, ..., az, ba, ..."""
    return ["".join(letters) for letters in product(string.ascii_lowercase, repeat=SUFFIX_LETTERS)][:count]


def part_groups(folder: Path) -> dict[str, list[Path]]:
    """{wheel file name: its parts in suffix order} for every `<wheel>.part-<suffix>` in `folder`."""
    groups: dict[str, list[Path]] = {}
    for part in sorted(folder.glob(f"*.whl{PART_MARK}*")):
        groups.setdefault(part.name.split(PART_MARK)[0], []).append(part)
    return groups


def assemble(folder: Path) -> list[tuple[Path, int]]:
    """Put every split wheel of `folder` back together (the parts are kept): [(wheel, parts)]. WheelError when a
    suffix is missing (aa, ac: no ab) or a part other than the last is not as large as the first (a truncated
    copy); a missing last part shows as a wrong hash in `verify`."""
    assembled = []
    for wheel_name, parts in part_groups(folder).items():
        suffixes = [part.name.split(PART_MARK)[1] for part in parts]
        expected = split_suffixes(len(parts))
        if suffixes != expected:
            missing = sorted(set(split_suffixes(len(parts) + 1)) - set(suffixes))[:1]
            raise WheelError(f"{wheel_name}: parts {', '.join(suffixes)} in {folder}: not consecutive, "
                             f"{PART_MARK}{missing[0] if missing else '?'} is missing")
        sizes = [part.stat().st_size for part in parts]
        if any(size != sizes[0] for size in sizes[:-1]) or sizes[-1] > sizes[0]:
            raise WheelError(f"{wheel_name}: parts of unequal sizes {sizes}: one was cut short in transfer")
        target = folder / wheel_name
        partial = target.with_name(target.name + ".assembling")
        with partial.open("wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(CHUNK_BYTES):
                        out.write(chunk)
        partial.replace(target)
        assembled.append((target, len(parts)))
    return assembled


def check_folder(folder: Path, locks=None) -> dict:
    """Assemble, then verify every wheel of `folder` -> {"wheels": {file: sha256}, "assembled": {file: parts}}."""
    assembled = {wheel.name: parts for wheel, parts in assemble(folder)}
    wheels = {wheel.name: verify(wheel, locks) for wheel in sorted(folder.glob("*.whl"))}
    if not any(wheel_name_version(Path(name))[0] == BIG_WHEEL for name in wheels):
        raise WheelError(f"no {BIG_WHEEL} wheel (nor its parts) in {folder}")
    return {"wheels": wheels, "assembled": assembled}


def split_wheel(wheel: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """Cut `wheel` into parts as `split -b` does, then remove it: [parts]."""
    parts = []
    with wheel.open("rb") as f:
        for suffix in split_suffixes(wheel.stat().st_size // part_bytes + 1):
            chunk = f.read(part_bytes)
            if not chunk:
                break
            parts.append(wheel.with_name(f"{wheel.name}{PART_MARK}{suffix}"))
            parts[-1].write_bytes(chunk)
    wheel.unlink()
    return parts


def wanted(exclude=IMAGE_PROVIDES, tools=TOOLS) -> list[str]:
    """The requirement lines (`name==version --hash=...`) of the folder: the serving lock less `exclude`, and
    `tools` from the dev lock."""
    serving, dev = parse_lock(SERVING_LOCK), parse_lock(DEV_LOCK)
    chosen = {name: entry for name, entry in serving.items()
              if not any(fnmatch(name, normalize(pattern)) for pattern in exclude)}
    for tool in map(normalize, tools):
        chosen.setdefault(tool, dev[tool])
    return [f"{name}=={version} " + " ".join(f"--hash=sha256:{h}" for h in hashes)
            for name, (version, hashes) in sorted(chosen.items())]


def prepare(folder: Path, exclude=IMAGE_PROVIDES) -> list[Path]:
    """`make gpu-wheels`: download the folder's wheels (hashes checked by pip) and split the big one -> [files]."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as requirements:
        requirements.write("\n".join(wanted(exclude)) + "\n")
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--require-hashes", "--python-version", PYTHON_VERSION, "--implementation", "cp", "--abi", ABI,
                    "--abi", "abi3", "--abi", "none", *platforms, "-d", str(folder), "-r", requirements.name],
                   check=True)
    Path(requirements.name).unlink()
    for wheel in folder.glob("*.whl"):
        if wheel_name_version(wheel)[0] == BIG_WHEEL:
            for stale in folder.glob(f"{wheel.name}{PART_MARK}*"):
                stale.unlink()
            split_wheel(wheel)
    return sorted(folder.iterdir())
