"""`python -m service`: serve the model repository with uvicorn, configured from the environment (TSERVE_*)."""

from __future__ import annotations

import uvicorn

from service.app import create_app
from service.logs import configure_logging
from service.settings import get_settings


def main() -> None:
    settings = get_settings()
    configure_logging(settings.log_level, settings.log_format)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_config=None, access_log=False,
                timeout_graceful_shutdown=int(settings.drain_timeout_s) or None)


if __name__ == "__main__":
    main()
