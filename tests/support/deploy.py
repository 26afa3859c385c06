"""Helpers shared by the deployment tests: the system tools they run (skipped, or failed under CI, when absent),
deploy/nginx/nginx.conf rendered for loopback upstreams, and a bounded wait that watches a process."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT

DEPLOY = ROOT / "deploy"
# the Debian package that provides each tool (deploy/ci-packages.txt lists them for .ci/run)
TOOLS = {"promtool": "prometheus", "prometheus": "prometheus", "nginx": "nginx", "docker-compose": "docker-compose"}


def require_tool(name: str) -> str:
    """The path of a system tool a deployment test runs for real (nginx, prometheus, promtool, docker-compose).

    Absent from PATH, the test is skipped with one line naming the tool and the command that installs it (a
    developer's machine); with TSERVE_REQUIRE_TOOLS=1 in the environment (.ci/run sets it) it fails instead,
    so CI can never pass by skipping."""
    path = shutil.which(name)
    if path is None:
        message = (f"`{name}` not found on PATH: install it with `sudo apt-get install {TOOLS.get(name, name)}` "
                   f"(deploy/ci-packages.txt)")
        if os.environ.get("TSERVE_REQUIRE_TOOLS", "") not in ("", "0"):
            pytest.fail(f"{message}; TSERVE_REQUIRE_TOOLS is set (.ci/run), so a missing tool is a failure",
                        pytrace=False)
        try:  # reported at the test's own line, not this one (pytest's option for skip marks)
            skip = pytest.skip.Exception(message, _use_item_location=True)
        except TypeError:  # a pytest without that option
            skip = pytest.skip.Exception(message)
        raise skip
    return path


def render_nginx_conf(prefix: Path, listen: str, upstreams: list[str]) -> Path:
    """deploy/nginx/nginx.conf with loopback upstreams, a loopback listen address and its paths under prefix."""
    text = (DEPLOY / "nginx" / "nginx.conf").read_text()
    server_line = re.search(r"^(\s*)server api:8000( [^;]*);$", text, flags=re.M)
    assert server_line, "nginx.conf: `server api:8000 ...;` not found in the upstream block"
    indent, params = server_line.groups()
    text = text.replace(server_line.group(0), "\n".join(f"{indent}server {u}{params};" for u in upstreams))
    assert "listen 80;" in text
    text = text.replace("listen 80;", f"listen {listen};").replace("/tmp/nginx", str(prefix / "run"))
    text = text.replace("access_log /dev/stdout", f"access_log {prefix / 'access.log'}")
    (prefix / "run").mkdir(parents=True, exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(text)
    return conf


def wait_for(what: str, check, timeout: float, process: subprocess.Popen | None = None,
             interval: float = 0.25):
    """Poll check() until it returns a truthy value (returned) or timeout; fail early if process exits."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{what}: the process exited with {process.returncode}")
        try:
            result = check()
            if result:
                return result
            last = result
        except (httpx.TransportError, KeyError, IndexError, ValueError) as error:
            last = error
        time.sleep(interval)
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r})")
