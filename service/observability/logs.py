"""Logging: one JSON object per line (or plain text), and the per-request access line.

The access line carries the request id (accepted from and echoed in `X-Request-ID`), method, path, model,
version, mode, status and latency, and with tracing on (`service.observability.tracing`) the request's `trace_id` (32 hex
digits); uvicorn's own access log is turned off in favour of it.
"""

from __future__ import annotations

import json
import logging
import sys
import time

ACCESS_LOGGER = "tserve.access"


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        payload = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        payload.update(getattr(record, "fields", {}))
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        return json.dumps(payload, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        return f"{line} {json.dumps(fields, ensure_ascii=False)}" if fields else line


def configure_logging(level: str = "INFO", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JSONFormatter() if fmt == "json" else
                         TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    logging.getLogger("uvicorn.access").disabled = True


def log_access(**fields) -> None:
    logging.getLogger(ACCESS_LOGGER).info("request", extra={"fields": fields})
