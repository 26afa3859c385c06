"""ASGI middleware around every request: request id, body size and body time limits, a JSON 500 for anything
unexpected, the request metrics and the access log, and the request's trace span when tracing is on
(`service.observability.tracing`; its trace id goes into the access log).

A pure ASGI middleware (not `BaseHTTPMiddleware`), so streamed responses pass through untouched and the request
duration runs to the last byte. Routes put `model`, `version` and `mode` into `request.state` for the labels, and
`failure_reason` when a request fails after its status was sent (a stream); each request counts as one failure at
most, here, by that reason or by its status.

The body limits hold for chunked bodies too (no Content-Length): the receive channel counts the bytes and the time,
and raises `ClientBodyError` (413 or 408) into whatever reads the body. An unexpected exception before the response
started becomes a JSON 500 here, so uvicorn never sees it and keeps the connection open for the client's next
request; once a response has started, the connection has to be cut (re-raised), as its body cannot be completed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid

from service.observability import tracing
from service.errors import OPENAI_PATHS, ClientBodyError, error_payload
from service.observability.logs import log_access
from service.observability.metrics import Metrics

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = b"x-request-id"
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
ENDPOINTS = {"/v1/translate", "/v1/generate", "/v1/classify", "/v1/models", "/v1/completions", "/v1/chat/completions",
             "/health/live", "/health/ready", "/metrics"}
# The Open Inference Protocol's inference paths name the model (/v2/models/{name}[/versions/{v}]/infer): one label
OIP_INFER = "/v2/models/{model}/infer"


def _endpoint(path: str) -> str:
    """The endpoint label of a path: a known route, or "other" (bounded cardinality, whatever clients send)."""
    if path in ENDPOINTS:
        return path
    if path.startswith("/v2/models/") and path.endswith("/infer"):
        return OIP_INFER
    return "other"


# Failures by final status (unless the route set `failure_reason`); 499 = the client went away.
FAILURE_REASONS = {400: "bad_input", 401: "unauthorized", 404: "bad_input", 405: "bad_input", 408: "bad_input",
                   413: "bad_input", 415: "bad_input", 422: "bad_input", 429: "queue_full", 499: "cancelled",
                   500: "internal", 503: "unavailable", 504: "timeout"}


class RequestMiddleware:
    def __init__(self, app, metrics: Metrics, max_body_bytes: int, body_timeout_s: float):
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        headers = dict(scope.get("headers") or [])
        given = headers.get(REQUEST_ID_HEADER, b"").decode("latin-1")
        request_id = given if _SAFE_ID.match(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        span = tracing.start_request(scope, headers) if tracing.tracer is not None else None  # off: one check
        failure = None
        status = 500
        response_started = False

        async def send_with_id(message):
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status = message["status"]
                response_started = True
                message["headers"] = list(message.get("headers", [])) + [(REQUEST_ID_HEADER, request_id.encode())]
            await send(message)

        received, body_complete = 0, False
        body_deadline = time.monotonic() + self.body_timeout_s

        async def limited_receive():
            """The client's messages; the body must stay within the size limit and arrive before its deadline."""
            nonlocal received, body_complete
            if body_complete:  # after the body: waiting for a disconnect is not limited
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, body_deadline - time.monotonic()))
            except TimeoutError:
                raise ClientBodyError(408, "body_timeout", f"the request body did not arrive within "
                                      f"{self.body_timeout_s:g} s (TSERVE_BODY_TIMEOUT_S)") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_complete = not message.get("more_body", False)
                if received > self.max_body_bytes:
                    raise self._too_large()
            return message

        declared = headers.get(b"content-length", b"0")
        try:
            if declared.isdigit() and int(declared) > self.max_body_bytes:
                error = self._too_large()
                await self._send_error(scope, send_with_id, error.status_code, error.type, error.detail, error.headers)
            else:
                await self.app(scope, limited_receive, send_with_id)
        except Exception as exc:
            failure = exc
            if response_started:
                raise  # a response is under way: only cutting the connection tells the client it is incomplete
            log.exception("unhandled error on %s", scope.get("path"))
            await self._send_error(scope, send_with_id, 500, "internal_error", "internal error; see the server log")
        finally:
            for loaded in state.pop("leases", ()):  # the model versions the request resolved (serving.context)
                loaded.release()
            trace_id = None if span is None else span.end(scope, state, status, failure)
            self._observe(scope, state, status, time.perf_counter() - started, request_id, trace_id)

    def _too_large(self) -> ClientBodyError:
        return ClientBodyError(413, "payload_too_large",
                               f"request body exceeds {self.max_body_bytes} bytes (TSERVE_MAX_BODY_BYTES)")

    @staticmethod
    async def _send_error(scope, send, status: int, error_type: str, message: str, headers: dict | None = None) -> None:
        status, payload = error_payload(scope.get("path", ""), status, error_type, message)
        body = json.dumps(payload).encode()
        extra = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())] + extra})
        await send({"type": "http.response.body", "body": body})

    def _observe(self, scope, state, status: int, seconds: float, request_id: str,
                 trace_id: str | None = None) -> None:
        path = scope.get("path", "")
        endpoint = _endpoint(path)
        model, version, mode = state.get("model", ""), str(state.get("version", "")), state.get("mode", "")
        if endpoint.startswith(("/v1/", OIP_INFER)):
            api = "oip" if endpoint == OIP_INFER else "openai" if path in OPENAI_PATHS else "native"
            self.metrics.request_duration.labels(endpoint=endpoint, api=api, model=model, version=version, mode=mode,
                                                 status=str(status)).observe(seconds)
            reason = state.get("failure_reason") or FAILURE_REASONS.get(status)
            if reason:
                self.metrics.failures.labels(model=model or "none", version=version, reason=reason).inc()
        if endpoint not in ("/metrics", "/health/live", "/health/ready"):
            log_access(request_id=request_id, method=scope.get("method"), path=path, model=model or None,
                       version=int(version) if version else None, mode=mode or None, status=status,
                       latency_ms=round(seconds * 1000, 2), **({"trace_id": trace_id} if trace_id else {}))
