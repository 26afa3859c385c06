"""`python -m service` in a subprocess, for the project's own clients: the end-to-end and deployment tests, the
benchmarks (bench/) and `export.verify_served`. Standard library only: the serving install has no HTTP client.

    with ServiceProcess("verify", repository, models='["vit"]', log_level="WARNING") as server:
        urllib.request.urlopen(f"{server.url}/v1/models")

Keyword arguments become TSERVE_<NAME> settings; `start()` spawns on a free loopback port and polls /health/ready
(a server that exits or is not ready in time is a ServiceStartError with its output); `stop()` sends SIGTERM, then
SIGKILL, to the process's group and reaps it. Output is collected by reader threads, or with `log_path` written
by the process itself. `command(port)` launches something else that answers /health/ready the same way.

Invariant: a launched server's settings are only what its caller passed (and the defaults): it runs on a clean
environment (no inherited TSERVE_* variable), in a working directory outside the checkout (no stray .env file).

Design notes: docs/architecture.md, service/client/launcher.py.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Self

from service.client.processes import (
    LOOPBACK,
    REAP_TIMEOUT_S,
    STOP_GRACE_S,
    die_with_parent,
    free_port,
    signal_group,
    stop_process_group,
)

__all__ = ["ServiceProcess", "ServiceStartError", "clean_environment"]

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # where `service` is imported from (service/client/ -> root)
READY_PATH = "/health/ready"
PORT_ATTEMPTS = 3  # spawns on a fresh port when the one chosen was taken before the server bound it
# Readiness: the poll's per-request timeout, the pause between polls, and how long start() waits by default (a
# model repository loads and warms up in well under it).
READY_POLL_TIMEOUT_S, READY_POLL_INTERVAL_S, READY_TIMEOUT_S = 2.0, 0.1, 120.0
READY_STATUS = 200
ERROR_BODY_CHARS = 300  # of a not-ready answer's body, shown in a start error
READER_JOIN_S = 5.0  # how long stop() waits for the output reader threads once the process is gone
# what log_records() and access_records() read: JSON lines, the access log's INFO records; no gRPC port, so that
# launched servers run side by side (a knob `grpc_port=N` turns it on). Knobs override them.
DEFAULTS = {"TSERVE_HOST": LOOPBACK, "TSERVE_LOG_FORMAT": "json", "TSERVE_LOG_LEVEL": "INFO", "TSERVE_GRPC_PORT": "0"}
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never through an http_proxy


class ServiceStartError(RuntimeError):
    """The service exited before it was ready, or was not ready in time; the message ends with its output."""


def clean_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any TSERVE_* variable, with the checkout importable (when `service` is
    imported from one), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TSERVE_")}
    if (PACKAGE_ROOT / "pyproject.toml").is_file():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    env.update(extra or {})
    return env


class ServiceProcess:
    """`python -m service` (or `command(port)`) in a subprocess on a free loopback port; see the module's docstring.

    name: shown in output() and errors. repository: TSERVE_REPOSITORY (resolved: the process runs elsewhere).
    workdir: its working directory (default: a temporary folder, removed at stop()). command: port -> argv, instead
    of `python -m service`; args: `python -m service`'s arguments (`--model_name`, `--model_dir`). env: more
    environment variables, over the defaults and knobs. log_path: output to this file instead of reader threads.
    ready_timeout: default of start() and wait_ready(). die_with_parent: SIGTERM the process when this one dies
    (preexec_fn: only for a client without threads, such as the benchmark).
    **knobs: settings, as TSERVE_<NAME>=str(value)."""

    def __init__(self, name: str = "service", repository: str | os.PathLike | None = None,
                 workdir: str | os.PathLike | None = None, *, command: Callable[[int], list[str]] | None = None,
                 args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 log_path: str | os.PathLike | None = None, ready_timeout: float = READY_TIMEOUT_S,
                 die_with_parent: bool = False, **knobs):
        self.name = name
        self.repository = None if repository is None else Path(repository).resolve()
        self.workdir = None if workdir is None else Path(workdir)
        self.knobs = {f"TSERVE_{k.upper()}": str(v) for k, v in knobs.items()}
        self.log_path = None if log_path is None else Path(log_path)
        self.ready_timeout = ready_timeout
        self._command, self._env, self._die_with_parent = command, dict(env or {}), die_with_parent
        self._args = list(args)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.command: list[str] = []  # as run, with the environment:
        self.environment: dict[str, str] = {}
        self.ready_seconds: float | None = None  # from spawn to ready
        self._spawned_at = 0.0
        self._since: tuple[int, int] = (0, 0)  # where the current attempt's output starts (lines, or log bytes)
        self._readers: list[threading.Thread] = []
        self._tmpdir: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    # --- lifecycle -----------------------------------------------------------------------------------------------

    def spawn(self) -> Self:
        """Start the process on a free port without waiting for it (see wait_ready(); start() does both)."""
        self.port = free_port()
        if self.workdir is None and self._tmpdir is None:
            self._tmpdir = Path(tempfile.mkdtemp(prefix="tserve-service-"))
        self.environment = env = self._environment()
        self.command = self._command(self.port) if self._command else [sys.executable, "-m", "service", *self._args]
        options = {"cwd": self.workdir or self._tmpdir, "env": env, "stdin": subprocess.DEVNULL,
                   "start_new_session": True, "preexec_fn": die_with_parent if self._die_with_parent else None}
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("ab" if self.proc else "wb") as log:  # a retry appends to the failed attempt's
                self._since = (log.tell(), 0)
                self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, **options)
        else:
            self._since = (len(self.stdout), len(self.stderr))
            self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         encoding="utf-8", errors="replace", bufsize=1, **options)
            self._readers = [threading.Thread(target=self._read, args=(stream, sink), daemon=True)
                             for stream, sink in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr))]
            for reader in self._readers:
                reader.start()
        self._spawned_at = time.monotonic()
        return self

    def _environment(self) -> dict[str, str]:
        """Clean environment; for the service the defaults, then repository and knobs, `env`, and the port."""
        service = self._command is None
        env = clean_environment({"PYTHONUNBUFFERED": "1", **(DEFAULTS if service else {})})
        if self.repository is not None:
            env["TSERVE_REPOSITORY"] = str(self.repository)
        env.update(self.knobs)
        env.update(self._env)
        if service:
            env["TSERVE_PORT"] = str(self.port)
        return env

    @staticmethod
    def _read(stream, sink: list[str]) -> None:
        for line in stream:
            sink.append(line.rstrip("\n"))

    def _readiness(self) -> tuple[bool, str]:
        try:
            with _DIRECT.open(self.url + READY_PATH, timeout=READY_POLL_TIMEOUT_S) as response:
                return response.status == READY_STATUS, str(response.status)
        except urllib.error.HTTPError as error:  # 503 while loading
            body = error.read(ERROR_BODY_CHARS).decode("utf-8", "replace") if error.fp else ""
            error.close()
            return False, f"{error.code} {body}"
        except (OSError, http.client.HTTPException) as error:  # refused, reset, timed out
            return False, type(error).__name__

    def wait_ready(self, timeout: float | None = None) -> Self:
        """Poll /health/ready until it answers 200. ServiceStartError if the process exits first or `timeout` (default
        ready_timeout) seconds pass; the process is left as it is."""
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self._join_readers()
                raise ServiceStartError(f"{self.name}: exited with {self.proc.returncode} before it was ready\n"
                                        f"{self.output()}")
            ready, answer = self._readiness()
            if ready:
                self.ready_seconds = time.monotonic() - self._spawned_at
                return self
            if time.monotonic() > deadline:
                raise ServiceStartError(f"{self.name}: not ready after {timeout:.0f} s (last answer: {answer})\n"
                                        f"{self.output()}")
            time.sleep(READY_POLL_INTERVAL_S)

    def start(self, timeout: float | None = None) -> Self:
        """spawn() and wait_ready(); on another port if the port was taken. Stops the process on any failure."""
        try:
            for attempt in range(1, PORT_ATTEMPTS + 1):
                self.spawn()
                try:
                    return self.wait_ready(timeout)
                except ServiceStartError:
                    if attempt < PORT_ATTEMPTS and self.proc.poll() is not None and self._port_taken():
                        continue
                    raise
        except BaseException:
            self.stop()
            raise
        raise AssertionError("unreachable")

    def _port_taken(self) -> bool:
        if self.log_path is not None:
            with self.log_path.open("rb") as log:
                log.seek(self._since[0])
                output = log.read().decode("utf-8", "replace")
        else:
            output = "\n".join(self.stdout[self._since[0]:] + self.stderr[self._since[1]:])
        return "address already in use" in output.lower()

    def send_signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None if the process is still running after `timeout` seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = STOP_GRACE_S) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds; always reaps the process and joins
        the reader threads. Returns the exit status (None if it never started)."""
        if self.proc is not None:
            stop_process_group(self.proc, timeout)
            self._join_readers()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        return None if self.proc is None else self.proc.returncode

    def kill(self) -> None:
        """SIGKILL at once (a crash, for tests of what survives one); reaps the process."""
        if self.proc is not None and self.proc.poll() is None:
            signal_group(self.proc, signal.SIGKILL)
            self.proc.wait(REAP_TIMEOUT_S)
        self._join_readers()

    def _join_readers(self) -> None:
        for reader in self._readers:
            reader.join(timeout=READER_JOIN_S)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- output --------------------------------------------------------------------------------------------------

    def output(self, since: tuple[int, int] = (0, 0)) -> str:
        """What the process wrote (from line `since` of stdout and stderr), under a header with its knobs."""
        knobs = " ".join(f"{k}={v}" for k, v in self.knobs.items()) or "defaults"
        if self.log_path is not None:
            text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
            return f"--- {self.name} ({knobs}) {self.log_path} ---\n{text}"
        return (f"--- {self.name} ({knobs}) stdout ---\n" + "\n".join(self.stdout[since[0]:])
                + f"\n--- {self.name} stderr ---\n" + "\n".join(self.stderr[since[1]:]))

    def log_records(self) -> list[dict]:
        """The output lines that are JSON objects: the service's log records (TSERVE_LOG_FORMAT=json)."""
        if self.log_path is not None:
            lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        else:
            lines = list(self.stdout)
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records

    def access_records(self, request_id: str | None = None) -> list[dict]:
        """The access log's records (logger tserve.access), of one request id if given."""
        return [r for r in self.log_records() if r.get("logger") == "tserve.access"
                and (request_id is None or r.get("request_id") == request_id)]
