"""Helpers shared by the deployment tests."""

from __future__ import annotations

import re
from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


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
