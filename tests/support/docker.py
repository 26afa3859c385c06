"""The Docker Engine API for the tests that run the images `make images` builds (tests/deploy/test_compose_stack.py,
tests/deploy/test_kserve_image.py): a client of the daemon, an image's inspection, and why the images cannot run
here, in one line. Without a daemon or the images a module is skipped with that line (a developer's machine), as
`tests.support.deploy.require_tool` skips a test whose tool is missing; under CI (TSERVE_REQUIRE_TOOLS=1) it fails.
"""

from __future__ import annotations

import os
from urllib.parse import quote

import httpx

# the name deploy/images.sh gives the service's image (TSERVE_IMAGE also names it there and in docker-compose.yml)
API_IMAGE = os.environ.get("TSERVE_IMAGE", "tserve:cpu")
API_TIMEOUT_S = 30
PING_TIMEOUT_S = 5


def docker_api() -> tuple[httpx.Client | None, str]:
    """A client of the Docker Engine API (DOCKER_HOST, else /var/run/docker.sock; None for another kind of
    DOCKER_HOST), and where it points."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if host.startswith("unix://"):
        transport = httpx.HTTPTransport(uds=host.removeprefix("unix://"))
        return httpx.Client(transport=transport, base_url="http://docker", timeout=API_TIMEOUT_S), host
    if host.startswith("tcp://"):
        return httpx.Client(base_url=f"http://{host.removeprefix('tcp://')}", timeout=API_TIMEOUT_S,
                            trust_env=False), host
    return None, host


def image(docker: httpx.Client, name: str) -> dict | None:
    response = docker.get(f"/images/{quote(name, safe='')}/json")
    return response.json() if response.status_code == 200 else None


def docker_problem(images: tuple[str, ...]) -> str | None:
    """Why `images` cannot run here (no Docker daemon, or an image not built), in one line; None if they can."""
    docker, host = docker_api()
    if docker is None:
        return f"DOCKER_HOST={host}: this test speaks to unix:// or plain tcp:// daemons only"
    with docker:
        try:
            docker.get("/_ping", timeout=PING_TIMEOUT_S).raise_for_status()
        except httpx.HTTPError as error:
            return (f"no Docker daemon answers at {host} ({type(error).__name__}): start one (`sudo dockerd &`; "
                    f"install: `sudo apt-get install docker.io mmdebstrap`), then `make images`")
        missing = [name for name in images if image(docker, name) is None]
    if missing:
        return f"image(s) {', '.join(missing)} not found: build them with `make images`"
    return None
