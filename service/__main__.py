"""`python -m service`: serve the model repository with uvicorn, configured from the environment (TSERVE_*)."""

from __future__ import annotations

import signal
import sys

import uvicorn

from service.app import create_app
from service.http.limits import REJECT_REASONS, limited_http_protocol
from service.observability.logs import configure_logging
from service.settings import SettingsInvalid, get_settings

EXIT_BAD_CONFIGURATION = 2  # as a command line's usage error


def main() -> None:
    try:
        settings = get_settings()
    except SettingsInvalid as error:  # one line per bad variable, no traceback
        sys.stderr.write(f"tserve: invalid configuration:\n{error}\n")
        sys.exit(EXIT_BAD_CONFIGURATION)
    configure_logging(settings.log_level, settings.log_format)
    # uvicorn re-raises a caught SIGTERM after its graceful shutdown, with the handler that was there before it:
    # make that a clean exit (status 0) rather than death by signal.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    app = create_app(settings)
    # slow or oversized request heads are answered (408 / 431) and closed in the HTTP protocol, before the app
    rejected = app.state.metrics.rejected_connections
    for reason in REJECT_REASONS:
        rejected.labels(reason=reason)  # the series exist at zero from the start
    http = limited_http_protocol(settings, on_reject=lambda reason: rejected.labels(reason=reason).inc())
    uvicorn.run(app, host=settings.host, port=settings.port, http=http, log_config=None, access_log=False,
                timeout_graceful_shutdown=int(settings.drain_timeout_s) or None)


if __name__ == "__main__":
    main()
