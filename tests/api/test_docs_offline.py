"""`/docs` (Swagger UI) and `/redoc` (ReDoc) work on a machine without internet: loaded in headless Chromium (Debian's
`chromium`) with every host but the server's made unresolvable, each page renders the API's operations, and the
page requested nothing from anywhere but the server (Chromium's net log); its scripts fetched `/openapi.json` from
the server (the server's access log), as "Try it out" does. The assets served are the fastapi-offline package's.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from service.http.docs import ASSETS, ASSETS_PATH
from tests.support.deploy import require_tool, wait_for

pytestmark = pytest.mark.slow

# (page, the assets it loads) for both pages; both load /openapi.json too
PAGES = {"/docs": ("swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"),
         "/redoc": ("redoc.standalone.js", "favicon.png")}
# The operations each page must show.
OPERATIONS = [("post", "/v1/completions"), ("post", "/v1/generate"), ("post", "/v2/models/{name}/infer")]
# Virtual time for the page's scripts (Chromium stops the clock while a request is pending), and the real limit.
RENDER_BUDGET_MS, CHROMIUM_TIMEOUT_S = 20_000, 120
ACCESS_LOG_WAIT_S = 10.0


@pytest.fixture(scope="module")
def server(server_factory):
    with server_factory("docs server", models='["gpt"]') as process:
        yield process


@pytest.fixture(scope="module")
def operation_ids(server) -> dict[tuple[str, str], str]:
    spec = httpx.get(f"{server.url}/openapi.json").json()
    return {(method, path): spec["paths"][path][method]["operationId"] for method, path in OPERATIONS}


def load_offline(chromium: str, url: str, workdir: Path) -> tuple[str, list[str]]:
    """The page's DOM once its scripts ran, and the URL of every request the page made (not Chromium's own)."""
    net_log = workdir / "net-log.json"
    command = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={workdir / 'profile'}", f"--log-net-log={net_log}",
               "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",  # no internet: only the server resolves
               f"--virtual-time-budget={RENDER_BUDGET_MS}", "--dump-dom", url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    log = json.loads(net_log.read_text())
    start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    origin = re.match(r"^https?://[^/]+", url).group(0)
    # the page itself, and what its document and scripts asked for (initiated by its origin); not Chromium's own
    # requests (updates, accounts, autofill), initiated by no origin
    jobs = [event.get("params", {}) for event in log["events"] if event["type"] == start_job]
    requested = [job["url"] for job in jobs
                 if job.get("initiator") == origin or job.get("request_type") == "main frame"]
    return done.stdout, requested


def access_log_paths(server, since: int) -> set[str]:
    paths = set()
    for line in server.stdout[since:]:
        if '"tserve.access"' in line:
            paths.add(json.loads(line)["path"])
    return paths


@pytest.mark.parametrize("page", list(PAGES))
def test_the_page_renders_from_the_server_alone(server, operation_ids, tmp_path, page):
    chromium = require_tool("chromium")
    since = len(server.stdout)
    dom, requested = load_offline(chromium, server.url + page, tmp_path)
    outside = [url for url in requested if not url.startswith(server.url + "/")]
    assert not outside, f"{page} requested {outside} from outside the server"
    wanted = {server.url + page, f"{server.url}/openapi.json", *(f"{server.url}{ASSETS_PATH}/{a}" for a in PAGES[page])}
    assert wanted <= set(requested)
    if page == "/docs":  # Swagger UI: one block per operation, its path in `data-path`
        shown = set(re.findall(r'class="opblock-summary-path" data-path="([^"]+)"', dom))
        assert {path for _, path in OPERATIONS} <= shown, sorted(shown)
    else:  # ReDoc: one section per operation, by its operationId
        for operation in OPERATIONS:
            assert f'data-section-id="operation/{operation_ids[operation]}"' in dom, operation
    # the page's own scripts fetched the schema from the server, as "Try it out" sends its requests there
    wait_for(f"{page}'s fetch of /openapi.json in the access log",
             lambda: {page, "/openapi.json"} <= access_log_paths(server, since), ACCESS_LOG_WAIT_S)


@pytest.mark.parametrize("asset", sorted({a for assets in PAGES.values() for a in assets}))
def test_the_assets_are_the_packages_own(server, asset):
    response = httpx.get(f"{server.url}{ASSETS_PATH}/{asset}")
    assert response.status_code == 200 and response.content == (ASSETS / asset).read_bytes()
    assert ASSETS.parts[-2:] == ("fastapi_offline", "static")  # the package's files, none of the project's
