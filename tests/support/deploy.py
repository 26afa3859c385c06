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
TOOLS = {"promtool": "prometheus", "prometheus": "prometheus", "nginx": "nginx", "docker-compose": "docker-compose",
         "redis-server": "redis-server"}


def require_tool(name: str) -> str:
    """The path of a system tool a test runs for real (nginx, prometheus, promtool, docker-compose, redis-server).

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


def render_nginx_conf(prefix: Path, listen: str, upstreams: list[str], grpc_listen: str | None = None,
                      grpc_upstreams: list[str] | None = None) -> Path:
    """deploy/nginx/nginx.conf with loopback upstreams, loopback listen addresses and its paths under prefix; the
    gRPC server listens on `grpc_listen` (default: the HTTP port + 1) and passes to `grpc_upstreams` (default: the
    HTTP upstreams' ports + 1, as TSERVE_GRPC_PORT is TSERVE_PORT + 1 by default)."""
    text = (DEPLOY / "nginx" / "nginx.conf").read_text()

    def plus_one(address: str) -> str:
        host, _, port = address.rpartition(":")
        return f"{host}:{int(port) + 1}"

    for port, servers in (("8000", upstreams), ("8001", grpc_upstreams or [plus_one(u) for u in upstreams])):
        server_line = re.search(rf"^(\s*)server api:{port}( [^;]*);$", text, flags=re.M)
        assert server_line, f"nginx.conf: `server api:{port} ...;` not found in an upstream block"
        indent, params = server_line.groups()
        text = text.replace(server_line.group(0), "\n".join(f"{indent}server {u}{params};" for u in servers))
    assert "listen 80;" in text and "listen 8001 http2;" in text
    text = text.replace("listen 80;", f"listen {listen};")
    text = text.replace("listen 8001 http2;", f"listen {grpc_listen or plus_one(listen)} http2;")
    text = text.replace("/tmp/nginx", str(prefix / "run"))
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
