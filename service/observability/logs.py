"""Logging: one JSON object per line (or plain text), and the per-request access line.

The access line carries the request id (accepted from and echoed in `X-Request-ID`), method, path, model,
version, mode, status and latency, and with tracing on (`service.observability.tracing`) the request's `trace_id` (32 hex
digits); uvicorn's own access log is turned off in favour of it.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import uuid

ACCESS_LOGGER = "tserve.access"
# The access log's latency: milliseconds, to 10 microseconds.
MS_PER_S, LATENCY_DECIMALS = 1000, 2
# A request id a client sends is kept when it is this tame (it goes into logs and headers), else one is made up.
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


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


def request_id(given: str) -> str:
    """The id a request goes by: the client's (`X-Request-ID`, gRPC's `x-request-id`) when it is tame, else new."""
    return given if _SAFE_ID.match(given) else uuid.uuid4().hex


def latency_ms(seconds: float) -> float:
    """A request's latency as the access line writes it."""
    return round(seconds * MS_PER_S, LATENCY_DECIMALS)


def log_access(**fields) -> None:
    logging.getLogger(ACCESS_LOGGER).info("request", extra={"fields": fields})
