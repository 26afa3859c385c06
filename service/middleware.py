"""ASGI middleware around every request: request id, body size limit, the request metrics and the access log.

A pure ASGI middleware (not `BaseHTTPMiddleware`), so streamed responses pass through untouched and the request
duration runs to the last byte. Routes put `model`, `version` and `mode` into `request.state` for the labels.
"""

from __future__ import annotations

import json
import re
import time
import uuid

from service.logs import log_access
from service.metrics import Metrics

REQUEST_ID_HEADER = b"x-request-id"
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
ENDPOINTS = {"/v1/translate", "/v1/generate", "/v1/classify", "/v1/models", "/health/live", "/health/ready",
             "/metrics"}
# Failures by final status; 499 (client gone) is counted where it is noticed, by the schedulers.
FAILURE_REASONS = {400: "bad_input", 404: "bad_input", 405: "bad_input", 413: "bad_input", 415: "bad_input",
                   422: "bad_input", 429: "queue_full", 500: "internal", 503: "unavailable", 504: "timeout"}


class BodyTooLarge(Exception):
    pass


class RequestMiddleware:
    def __init__(self, app, metrics: Metrics, max_body_bytes: int):
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        headers = dict(scope.get("headers") or [])
        given = headers.get(REQUEST_ID_HEADER, b"").decode("latin-1")
        request_id = given if _SAFE_ID.match(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        status = 500
        response_started = False

        async def send_with_id(message):
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status = message["status"]
                response_started = True
                message["headers"] = list(message.get("headers", [])) + [(REQUEST_ID_HEADER, request_id.encode())]
            await send(message)

        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge
            return message

        declared = headers.get(b"content-length", b"0")
        try:
            if declared.isdigit() and int(declared) > self.max_body_bytes:
                raise BodyTooLarge
            await self.app(scope, limited_receive, send_with_id)
        except BodyTooLarge:
            if response_started:
                raise
            await self._too_large(send_with_id)
        finally:
            self._observe(scope, state, status, time.perf_counter() - started, request_id)

    async def _too_large(self, send):
        body = json.dumps({"error": {"type": "payload_too_large",
                                     "message": f"request body exceeds {self.max_body_bytes} bytes"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def _observe(self, scope, state, status: int, seconds: float, request_id: str) -> None:
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        model, version, mode = state.get("model", ""), str(state.get("version", "")), state.get("mode", "")
        if endpoint.startswith("/v1/"):
            self.metrics.request_duration.labels(endpoint=endpoint, model=model, version=version, mode=mode,
                                                 status=str(status)).observe(seconds)
            reason = FAILURE_REASONS.get(status)
            if reason:
                self.metrics.failures.labels(model=model or "none", version=version, reason=reason).inc()
        if endpoint not in ("/metrics", "/health/live", "/health/ready"):
            log_access(request_id=request_id, method=scope.get("method"), path=path, model=model or None,
                       version=int(version) if version else None, mode=mode or None, status=status,
                       latency_ms=round(seconds * 1000, 2))
