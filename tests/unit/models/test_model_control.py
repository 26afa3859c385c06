"""Loading and unloading model versions without a restart (Triton's repository extension, TSERVE_MODEL_CONTROL):
roll `gpt` from version 1 to 2 and back while requests run, with zero failed requests, every response naming the
version that produced it, and the server's memory back to its level after the unloads; a version that fails to
load leaves the serving one untouched; model control is off by default."""

from __future__ import annotations

import shutil
import threading
import time

import httpx
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.support.server import ServerProcess

pytestmark = pytest.mark.slow

CLIENTS = 3
BODY = {"prompt": "ROMEO:\n", "max_new_tokens": 12, "temperature": 0}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


@pytest.fixture(scope="module")
def repository(tiny_repository_copy):
    return tiny_repository_copy("control-repository", ["gpt"], versions=("1", "2"))


def test_rolling_a_version_under_load_loses_no_request(repository, tmp_path):
    server = ServerProcess("model control server", repository, tmp_path, models='["gpt:1"]',
                           model_control="true").start()
    try:
        client = triton.InferenceServerClient(url=server.url.removeprefix("http://"))
        # (when the request was sent, status, version): a request sent after a version became active resolves it,
        # however long the busy machine then takes to answer (judged by order of events, not by a margin)
        outcomes: list[tuple[float, int, int | None]] = []
        stop = threading.Event()

        def load() -> None:
            with httpx.Client(base_url=server.url, timeout=30) as c:
                while not stop.is_set():
                    sent = time.monotonic()
                    response = c.post("/v1/generate", json=BODY)
                    version = response.json().get("version") if response.status_code == 200 else None
                    outcomes.append((sent, response.status_code, version))

        def control(action: str, version: int | None = None) -> httpx.Response:
            body = {"parameters": {"version": str(version)}} if version else {}
            response = httpx.post(f"{server.url}/v2/repository/models/gpt/{action}", json=body, timeout=120)
            assert response.status_code == 200, response.text
            return response

        time.sleep(0.5)
        rss_start = rss_mib(server.proc.pid)
        threads = [threading.Thread(target=load) for _ in range(CLIENTS)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)
        client.load_model("gpt")  # tritonclient: the highest version, 2, loaded, warmed, then active
        rolled_to_2 = time.monotonic()
        time.sleep(0.5)
        control("unload", 1)
        time.sleep(0.5)
        loading_1 = time.monotonic()  # from here requests may get 1 again
        control("load", 1)  # and back
        rolled_to_1 = time.monotonic()
        time.sleep(0.5)
        control("unload", 2)
        time.sleep(0.5)
        stop.set()
        for thread in threads:
            thread.join(timeout=30)

        statuses = [status for _, status, _ in outcomes]
        assert len(outcomes) > 20 and set(statuses) == {200}, [s for s in statuses if s != 200]
        assert {v for t, _, v in outcomes if rolled_to_2 < t < loading_1} == {2}
        assert {v for t, _, v in outcomes if t > rolled_to_1} == {1}
        assert {v for _, _, v in outcomes} == {1, 2}
        index = {(e["name"], e["version"]): e for e in client.get_model_repository_index()}
        assert index[("gpt", "1")]["state"] == "READY" and index[("gpt", "2")]["state"] == "UNAVAILABLE"
        time.sleep(0.5)
        rss_end = rss_mib(server.proc.pid)
        print(f"RSS: {rss_start:.0f} MiB with version 1, {rss_end:.0f} MiB after rolling to 2 and back")
        assert rss_end < rss_start + 40  # two loads and two unloads leave no version behind

        # a version that fails to load: a 400 with the reason, and version 1 serves on
        shutil.copytree(repository / "gpt" / "1", repository / "gpt" / "3")
        (repository / "gpt" / "3" / "decoder.onnx").write_bytes(b"not an onnx graph")
        failed = httpx.post(f"{server.url}/v2/repository/models/gpt/load", json={"parameters": {"version": "3"}})
        assert failed.status_code == 400 and "failed to load" in failed.json()["error"]
        assert httpx.post(f"{server.url}/v1/generate", json=BODY).json()["version"] == 1
        index = {(e["name"], e["version"]): e for e in client.get_model_repository_index()}
        assert index[("gpt", "3")]["state"] == "UNAVAILABLE" and "failed" in index[("gpt", "3")]["reason"]
        client.unload_model("gpt")  # every loaded version
        response = httpx.post(f"{server.url}/v1/generate", json=BODY)
        assert response.status_code == 404 and "no loaded version" in response.json()["error"]["message"]
        client.close()
    finally:
        server.stop()


def test_model_control_is_off_by_default(repository, tmp_path):
    server = ServerProcess("no control server", repository, tmp_path, models='["gpt:1"]').start()
    try:
        client = triton.InferenceServerClient(url=server.url.removeprefix("http://"))
        with pytest.raises(InferenceServerException) as refused:
            client.load_model("gpt")
        assert refused.value.status() == "403" and "TSERVE_MODEL_CONTROL" in refused.value.message()
        assert {e["version"] for e in client.get_model_repository_index() if e["state"] == "READY"} == {"1"}
        client.close()
    finally:
        server.stop()
