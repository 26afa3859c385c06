"""Helpers shared by the deployment tests."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
# the Debian package that provides each tool (deploy/ci-packages.txt lists them for .ci/run)
TOOLS = {"promtool": "prometheus", "prometheus": "prometheus", "nginx": "nginx", "docker-compose": "docker-compose"}


def require_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` not found on PATH: .ci/run must `apt-get install -y {TOOLS[name]}` "
                    f"(Debian package, listed in deploy/ci-packages.txt)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict[str, str]:
    """This process's environment without TSERVE_* settings, with the checkout importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TSERVE_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def start_service(repository: Path, port: int, cwd: Path, log: Path) -> subprocess.Popen:
    """`python -m service` on loopback with only the TSERVE_* settings given here (text logs into `log`)."""
    env = clean_env()
    env.update(TSERVE_REPOSITORY=str(repository), TSERVE_HOST="127.0.0.1", TSERVE_PORT=str(port),
               TSERVE_INTRA_OP_THREADS="1", TSERVE_LOG_FORMAT="text")
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "service"], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def stop_process_group(process: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM the process's session (it and its children), SIGKILL it after `grace` seconds; no-op once exited."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


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
