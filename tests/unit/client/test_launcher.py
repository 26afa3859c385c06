"""service.client.launcher on stand-in servers (standard library, no models, ~1 s): the clean environment and working
directory, readiness, a port taken meanwhile, exits and timeouts as errors with the output, file output, and
SIGTERM then SIGKILL. The real service is started through it by every end-to-end test."""

from __future__ import annotations

import json
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from service.client.launcher import ServiceProcess, ServiceStartError
from tests.support import ROOT


# port, then: "ok" (200), "busy" (503), "clash FILE" ("address already in use" the first time), "stubborn" (ignores
# SIGTERM). GET answers the TSERVE_* environment and the working directory.
STAND_IN = textwrap.dedent("""
    import json, os, pathlib, signal, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port, mode = int(sys.argv[1]), sys.argv[2]
    if mode == "clash" and not pathlib.Path(sys.argv[3]).exists():
        pathlib.Path(sys.argv[3]).touch()
        sys.exit("[Errno 98] error while attempting to bind on address: address already in use")
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"env": {k: v for k, v in os.environ.items() if k.startswith("TSERVE_")},
                               "cwd": os.getcwd()}).encode()
            self.send_response(503 if mode == "busy" else 200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    print(json.dumps({"logger": "tserve.access", "request_id": "r1", "status": 200}), flush=True)
    print("not json", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
""")


def stand_in(*mode: str):
    return lambda port: [sys.executable, "-c", STAND_IN, str(port), *mode]


def answer(process: ServiceProcess) -> dict:
    import urllib.request

    with urllib.request.urlopen(process.url + "/", timeout=5) as response:
        return json.loads(response.read())


def test_clean_environment_knobs_output_and_stop(monkeypatch):
    monkeypatch.setenv("TSERVE_INHERITED", "1")
    with ServiceProcess("stand-in", command=stand_in("ok"), max_queue_size=2, env={"TSERVE_EXTRA": "x"}) as process:
        seen = answer(process)
        assert seen["env"] == {"TSERVE_MAX_QUEUE_SIZE": "2", "TSERVE_EXTRA": "x"}  # nothing inherited
        workdir = Path(seen["cwd"])
        assert ROOT not in workdir.parents and workdir.is_dir()  # no stray .env of the checkout
        assert process.ready_seconds is not None and process.proc.poll() is None
    assert process.proc.returncode == -signal.SIGTERM and not workdir.exists()
    assert process.access_records("r1") == [{"logger": "tserve.access", "request_id": "r1", "status": 200}]
    assert process.stdout[-1] == "not json" and process.stderr == ["to stderr"]
    assert "TSERVE_MAX_QUEUE_SIZE=2" in process.output() and "to stderr" in process.output()


def test_the_service_is_configured_by_tserve_variables_only(monkeypatch, tmp_path):
    monkeypatch.setenv("TSERVE_MODELS", '["gpt"]')
    process = ServiceProcess("service", "relative/repository", tmp_path, log_level="WARNING", max_queue_size=2,
                             env={"OMP_WAIT_POLICY": "PASSIVE"})
    process.port = 1234
    env = process._environment()
    assert {k: v for k, v in env.items() if k.startswith("TSERVE_")} == {
        "TSERVE_HOST": "127.0.0.1", "TSERVE_LOG_FORMAT": "json", "TSERVE_LOG_LEVEL": "WARNING", "TSERVE_PORT": "1234",
        "TSERVE_REPOSITORY": str(Path("relative/repository").resolve()), "TSERVE_MAX_QUEUE_SIZE": "2",
        "TSERVE_GRPC_PORT": "0"}  # no gRPC port unless a knob asks: launched servers run side by side
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["PYTHONPATH"].split(":")[0] == str(ROOT)
    with_grpc = ServiceProcess("service", "relative/repository", tmp_path, grpc_port=8123)._environment()
    assert with_grpc["TSERVE_GRPC_PORT"] == "8123"


def test_an_exit_before_ready_is_an_error_with_the_output(tmp_path):
    process = ServiceProcess("broken", command=lambda port: [sys.executable, "-c", "import sys; sys.exit('boom')"])
    with pytest.raises(ServiceStartError, match=r"(?s)broken: exited with 1 before it was ready.*boom"):
        process.start()


def test_a_port_taken_meanwhile_is_retried_on_another(tmp_path):
    with ServiceProcess("clash", command=stand_in("clash", str(tmp_path / "tried"))) as process:
        assert answer(process)["env"] == {}
    assert (tmp_path / "tried").exists() and "address already in use" in process.output()  # the first attempt's


def test_not_ready_in_time_is_an_error_and_the_process_is_stopped():
    process = ServiceProcess("busy", command=stand_in("busy"), ready_timeout=1)
    with pytest.raises(ServiceStartError, match=r"not ready after 1 s \(last answer: 503"):
        process.start()
    assert process.proc.poll() is not None


def test_output_to_a_file_and_sigkill_after_the_grace_period(tmp_path):
    log = tmp_path / "logs" / "stubborn.log"
    process = ServiceProcess("stubborn", command=stand_in("stubborn"), log_path=log).start()
    assert process.stop(timeout=0.5) == -signal.SIGKILL
    assert process.stdout == [] and "to stderr" in log.read_text() and "to stderr" in process.output()
    assert [r["request_id"] for r in process.access_records()] == ["r1"]
