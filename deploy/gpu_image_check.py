"""`make gpu-image-check`: run inside tserve:gpu (no GPU needed), it checks that the CUDA provider could load there.

ONNX Runtime lists CUDAExecutionProvider whenever the wheel carries the provider library, so that alone proves
little: the check also resolves every shared library the provider needs (`ldd`, no "not found") and loads the
CUDA and cuDNN libraries ONNX Runtime opens at run time, all from the image's own files. The one library allowed
to be missing is the driver's libcuda.so.1, which the NVIDIA Container Toolkit mounts in on a GPU host. Prints one
line per check; exits 1 on the first failure. Standard library and onnxruntime only (it runs on the image's venv).
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
from pathlib import Path

import onnxruntime

PROVIDER = "CUDAExecutionProvider"
PROVIDER_LIBRARY = "libonnxruntime_providers_cuda.so"
# the driver's library: on a GPU host the NVIDIA Container Toolkit mounts it in; no image carries it
DRIVER_LIBRARIES = {"libcuda.so.1"}
# opened with dlopen by the provider or by cuDNN (not NEEDED entries, so ldd does not see them): the `cuda` and
# `cudnn` extras' libraries that onnxruntime.preload_dlls() would load; {major} is the wheel's CUDA major
RUNTIME_LIBRARIES = ("libcudnn.so.9", "libcufft.so.12", "libnvrtc.so.{major}")


def fail(message: str) -> None:
    print(f"FAIL {message}")
    sys.exit(1)


def main() -> None:
    from onnxruntime.capi import build_and_package_info as build

    print(f"onnxruntime {onnxruntime.__version__} ({build.package_name}), built for CUDA {build.cuda_version}")
    providers = onnxruntime.get_available_providers()
    if PROVIDER not in providers:
        fail(f"{PROVIDER} not in get_available_providers(): {providers}")
    print(f"ok   get_available_providers(): {providers}")

    library = Path(onnxruntime.__file__).parent / "capi" / PROVIDER_LIBRARY
    done = subprocess.run(["ldd", str(library)], capture_output=True, text=True, check=True)
    resolved = dict(re.findall(r"^\s*(\S+) => (.+?) \(0x", done.stdout, flags=re.M))
    missing = set(re.findall(r"^\s*(\S+) => not found", done.stdout, flags=re.M))
    major = build.cuda_version.split(".")[0]
    if missing - DRIVER_LIBRARIES:
        fail(f"{PROVIDER_LIBRARY} needs libraries the image lacks: {sorted(missing - DRIVER_LIBRARIES)}")
    cuda = sorted(name for name in resolved if name.startswith(("libcu", "libnvrtc")))
    if not any(name == f"libcudart.so.{major}" for name in cuda):
        fail(f"{PROVIDER_LIBRARY} does not link libcudart.so.{major}: {cuda}")
    for name in cuda:
        print(f"ok   {name} => {resolved[name]}")
    print(f"ok   missing only the driver's {sorted(missing)} (mounted by the NVIDIA Container Toolkit)")

    for name in (template.format(major=major) for template in RUNTIME_LIBRARIES):
        try:
            ctypes.CDLL(name)
        except OSError as error:
            fail(f"{name} does not load: {error}")
        print(f"ok   {name} loads")


if __name__ == "__main__":
    main()
