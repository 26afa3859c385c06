"""Start-up (`service.__main__`, the app's lifespan): a port the service cannot listen on, an unreadable .env or API
key file end the start before anything runs, with one line naming what is wrong (the whole start of a real process
with a port in use: tests/api/test_server_process.py); KServe's arguments (`--model_name`, `--model_dir`) take
precedence over the environment (served: tests/api/test_kserve_model_dir.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.__main__ import CannotListen, command_line, listen
from service.app import create_app
from service.client.processes import LOOPBACK, free_port
from service.settings import Settings, SettingsInvalid, load_settings

ROOT = Path(__file__).resolve().parents[2]
IN_USE = "address already in use"


@pytest.fixture(params=[False, True], ids=["plain", "reuse-port"])
def taken(request):
    """A port another process listens on: a plain listener, or one with SO_REUSEPORT (as a gRPC server's)."""
    with socket.create_server((LOOPBACK, 0), reuse_port=request.param) as holder:
        yield holder.getsockname()[1]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_port_in_use_cannot_be_listened_on_and_the_error_names_it(taken, protocol):
    ports = {"port": taken, "grpc_port": 0} if protocol == "http" else {"port": 0, "grpc_port": taken}
    setting = "HTTP, TSERVE_PORT" if protocol == "http" else "gRPC, TSERVE_GRPC_PORT"
    with pytest.raises(CannotListen) as caught:
        listen(Settings(host=LOOPBACK, **ports))
    assert str(caught.value) == f"cannot listen on {LOOPBACK}:{taken} ({setting}): {IN_USE}"


@pytest.mark.parametrize("ports, says", [
    ({"port": 70_000}, f"cannot listen on {LOOPBACK}:70000 (HTTP, TSERVE_PORT): bind(): port must be 0-65535"),
    ({"port": "same", "grpc_port": "same"}, "(gRPC, TSERVE_GRPC_PORT): " + IN_USE),
], ids=["past 65535", "HTTP and gRPC on one port"])
def test_ports_that_cannot_both_be_listened_on(ports, says):
    port = free_port()
    settings = Settings(host=LOOPBACK, **{k: port if v == "same" else v for k, v in ports.items()})
    with pytest.raises(CannotListen, match=says.replace("(", r"\(").replace(")", r"\)")):
        listen(settings)


def test_free_ports_give_the_http_socket_listening_and_leave_the_grpc_port_free():
    http_port, grpc_port = free_port(), free_port()
    with listen(Settings(host=LOOPBACK, port=http_port, grpc_port=grpc_port)) as http:
        assert http.getsockname()[1] == http_port
        with socket.create_connection((LOOPBACK, http_port), timeout=5):  # listening: the connection is queued
            pass
        with socket.create_server((LOOPBACK, grpc_port)):  # the check let it go
            pass


def test_the_grpc_port_is_bound_before_the_models_start_loading(taken, tmp_path):
    """A gRPC port taken after the check (another process was quicker) fails the app's start before the model
    loader starts: no thread of ONNX Runtime runs while the process exits."""
    app = create_app(Settings(repository=tmp_path, host=LOOPBACK, grpc_port=taken))
    loads = []
    app.state.registry.start_loading = lambda: loads.append("started")
    with pytest.raises(RuntimeError, match=f"{taken}"), TestClient(app):
        pass
    assert loads == []


def test_an_env_file_that_is_not_text_is_a_bad_configuration(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_bytes(b"TSERVE_PORT=\xff\xfe\n")
    with pytest.raises(SettingsInvalid, match=r"^\.env: cannot be read: it is not UTF-8 text$"):
        load_settings()


def test_an_unreadable_api_key_file_is_a_bad_configuration_without_a_traceback(tmp_path):
    env = {**os.environ, "TSERVE_API_KEYS_FILE": str(tmp_path / "missing"), "TSERVE_PORT": "0",
           "TSERVE_GRPC_PORT": "0", "TSERVE_REPOSITORY": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (f"TSERVE_API_KEYS_FILE ({tmp_path / 'missing'}): cannot read the API "
                                            f"key file: No such file or directory")


@pytest.mark.parametrize("argv, settings", [
    ([], {}),
    (["--model_name=translation", "--model_dir=/mnt/models"],
     {"model_name": "translation", "repository": "/mnt/models"}),
    (["--model_dir", "/srv/repository"], {"repository": "/srv/repository"}),
], ids=["none", "kserve-runtime", "repository-only"])
def test_the_command_line_gives_kserves_model_arguments(argv, settings):
    assert command_line(argv) == settings


def test_the_command_line_takes_precedence_over_the_environment(monkeypatch):
    monkeypatch.setenv("TSERVE_REPOSITORY", "/from/the/environment")
    monkeypatch.setenv("TSERVE_MODEL_NAME", "gpt")
    loaded = load_settings(command_line(["--model_dir=/mnt/models", "--model_name=de-en"]))
    assert (loaded.repository, loaded.model_name) == (Path("/mnt/models"), "de-en")
    assert load_settings(command_line([])).model_name == "gpt"


@pytest.mark.parametrize("argv", [["--model_name", "two words"], ["--model_name=a/b"], ["--port=1"]],
                         ids=["not-a-model-name", "a-path", "unknown-argument"])
def test_a_bad_argument_is_a_bad_configuration(argv):
    with pytest.raises((SettingsInvalid, SystemExit)) as caught:
        load_settings(command_line(argv))
    if caught.type is SystemExit:
        assert caught.value.code == 2  # argparse's usage error, as EXIT_BAD_CONFIGURATION
    else:
        assert str(caught.value).startswith("TSERVE_MODEL_NAME: ")
