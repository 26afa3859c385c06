"""The uv-compiled locks of requirements/ as data: each package's version, hashes and what requires it, and the
environment the locks are resolved for (Makefile LOCK_CPU and LOCK_GPU: the same, the images' Debian Python).
Read by tests/deploy/test_lock.py (agreement with the declarations) and tests/deploy/test_gpu.py (the GPU wheel)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name

CPU_TARGET = {"python_version": "3.11", "python_full_version": "3.11.0", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "os_name": "posix"}
GPU_TARGET = CPU_TARGET


@dataclass
class Locked:
    version: str
    hashes: list[str]
    via: list[str]  # what requires it: package names, `transformer-serving (pyproject.toml)`, `-r FILE`, `-c FILE`


def read_lock(path: Path) -> dict[str, Locked]:
    """A uv-compiled lock: {canonical name: Locked}."""
    packages: dict[str, Locked] = {}
    current = None
    in_via = False
    for line in path.read_text().splitlines():
        if match := re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==(\S+?)(?: ;.*?)?\s*\\?$", line):
            current = packages.setdefault(canonicalize_name(match[1]), Locked(match[2], [], []))
            in_via = False
        elif current and (match := re.match(r"^\s+--hash=sha256:([0-9a-f]{64})", line)):
            current.hashes.append(match[1])
        elif current and (match := re.match(r"^\s+# via(?: (.+))?$", line)):
            in_via = match[1] is None
            if match[1]:
                current.via.append(match[1].strip())
        elif current and in_via and (match := re.match(r"^\s+#   (.+)$", line)):
            current.via.append(match[1].strip())
        else:
            in_via = False
    return packages


