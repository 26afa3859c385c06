"""`python -m service`: serve the model repository with uvicorn, configured from the environment (TSERVE_*) and
KServe's model server arguments (`--model_name`, `--model_dir`: `command_line`), which take precedence.

A start that cannot serve ends before any model loads or any thread starts, with one line saying why and an exit
status of its own: invalid settings, .env or API key file (`EXIT_BAD_CONFIGURATION`, on stderr); a port it cannot
listen on (`EXIT_CANNOT_LISTEN`, logged, naming the port and the setting: in use, not permitted, not an address of
this host).
The HTTP socket is bound and listening here, then handed to uvicorn; the gRPC port is bound once here as a check
(the gRPC server binds it again in the app's lifespan, before the models start loading).
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys

import uvicorn
from uvicorn.config import STARTUP_FAILURE

from service.app import create_app
from service.http.auth import ApiKeyConfigError
from service.http.limits import REJECT_REASONS, limited_http_protocol
from service.observability.logs import configure_logging
from service.settings import Settings, SettingsInvalid, load_settings

log = logging.getLogger("service")

EXIT_BAD_CONFIGURATION = 2  # as a command line's usage error
EXIT_CANNOT_LISTEN = 4  # a port in use or not permitted (uvicorn's own start-up failure is 3)


class CannotListen(Exception):
    """A port the service cannot listen on; the message names it, its setting and the system's reason."""


def bind(host: str, port: int, what: str) -> socket.socket:
    """A TCP socket bound to host:port as uvicorn and gRPC bind theirs (SO_REUSEADDR: a port whose connections are
    in TIME_WAIT is free); CannotListen naming `what` (the protocol and its setting) if it cannot be."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, OverflowError) as error:  # OverflowError: a port past 65535
        sock.close()
        reason = (getattr(error, "strerror", None) or str(error)).lower()
        raise CannotListen(f"cannot listen on {host}:{port} ({what}): {reason}") from None
    return sock


def listen(settings: Settings) -> socket.socket:
    """The HTTP socket, listening; the gRPC port (when on) checked free by binding it once. CannotListen else."""
    http = bind(settings.host, settings.port, "HTTP, TSERVE_PORT")
    http.listen()  # from now on no other socket can bind the port, the gRPC check's included
    if settings.grpc_port:
        try:
            bind(settings.host, settings.grpc_port, "gRPC, TSERVE_GRPC_PORT").close()
        except CannotListen:
            http.close()
            raise
    return http


def command_line(argv: list[str]) -> dict[str, str]:
    """The settings the command line gives, as KServe's runtimes pass them (`--model_name={{.Name}}
    --model_dir=/mnt/models`: deploy/kserve/servingruntime.yaml); the environment gives the rest."""
    parser = argparse.ArgumentParser(prog="python -m service", description="Serve the model repository; every other "
                                     "setting is an environment variable TSERVE_* (docs/configuration.md).")
    parser.add_argument("--model_dir", metavar="DIR", help="TSERVE_REPOSITORY: with --model_name one model's folder "
                        "(DIR/<version>/config.json), else a model repository (DIR/<name>/<version>/)")
    parser.add_argument("--model_name", metavar="NAME", help="TSERVE_MODEL_NAME: serve the model in DIR as NAME")
    args = parser.parse_args(argv)  # a bad argument: usage on stderr, exit status 2 (EXIT_BAD_CONFIGURATION)
    return {setting: value for setting, value in (("repository", args.model_dir), ("model_name", args.model_name))
            if value is not None}


def bad_configuration(error: Exception) -> None:
    """Exit with the settings' problems (one line per bad variable or file), no traceback."""
    sys.stderr.write(f"tserve: invalid configuration:\n{error}\n")
    sys.exit(EXIT_BAD_CONFIGURATION)


def main() -> None:
    try:
        settings = load_settings(command_line(sys.argv[1:]))
    except SettingsInvalid as error:
        bad_configuration(error)
    configure_logging(settings.log_level, settings.log_format)
    try:
        http_socket = listen(settings)
    except CannotListen as error:  # nothing started yet: a plain exit
        log.error("%s", error)
        sys.exit(EXIT_CANNOT_LISTEN)
    # uvicorn re-raises a caught SIGTERM after its graceful shutdown, with the handler that was there before it:
    # make that a clean exit (status 0) rather than death by signal.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        app = create_app(settings)
    except ApiKeyConfigError as error:  # TSERVE_API_KEYS or the key file
        bad_configuration(error)
    # slow or oversized request heads are answered (408 / 431) and closed in the HTTP protocol, before the app
    rejected = app.state.metrics.rejected_connections
    for reason in REJECT_REASONS:
        rejected.labels(reason=reason)  # the series exist at zero from the start
    http = limited_http_protocol(settings, on_reject=lambda reason: rejected.labels(reason=reason).inc())
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, http=http, log_config=None,
                                           access_log=False,
                                           timeout_graceful_shutdown=int(settings.drain_timeout_s) or None))
    log.info("HTTP on %s:%d", settings.host, settings.port)
    server.run(sockets=[http_socket])
    if not server.started:  # as uvicorn.run: the app's start-up failed (logged by uvicorn)
        sys.exit(STARTUP_FAILURE)


if __name__ == "__main__":
    main()
