"""ASGI middleware around every request: request id, body size and body time limits, a JSON 500 for anything
unexpected, the request metrics and the access log, and the request's trace span when tracing is on
(`service.observability.tracing`; its trace id goes into the access log).

A pure ASGI middleware (not `BaseHTTPMiddleware`), so streamed responses pass through untouched and the request
duration runs to the last byte. The request's API and endpoint label come from its route (`service.http.apis`);
routes put `model`, `version`, `mode` (and `failure_reason` for a stream that fails) into `request.state`. The body
limits hold for chunked bodies too: the receive channel counts the bytes and the time, and raises `ClientBodyError`
(413 or 408) into whatever reads the body.

Invariant: each request counts as one failure at most, here; an unexpected exception before the response started
becomes a JSON 500 and the connection stays usable, after it the connection is cut (re-raised).

Design notes: docs/architecture.md, service/http/middleware.py.
"""

from __future__ import annotations

import asyncio
import logging
import time

from service.http.apis import ApiTable
from service.http.errors import ClientBodyError, send_error
from service.observability import tracing
from service.observability import logs
from service.observability.metrics import Metrics

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = b"x-request-id"
# An unexpected exception before the response started: a JSON 500 of this type, the connection kept usable.
INTERNAL_STATUS, INTERNAL_TYPE = 500, "internal_error"
# A body over TSERVE_MAX_BODY_BYTES, and one that did not arrive within TSERVE_BODY_TIMEOUT_S.
TOO_LARGE_STATUS, BODY_TIMEOUT_STATUS = 413, 408


class RequestMiddleware:
    def __init__(self, app, metrics: Metrics, apis: ApiTable, max_body_bytes: int, body_timeout_s: float):
        self.app = app
        self.metrics = metrics
        self.apis = apis
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        headers = dict(scope.get("headers") or [])
        given = headers.get(REQUEST_ID_HEADER, b"").decode("latin-1")
        request_id = logs.request_id(given)
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        span = tracing.start_request(scope, headers) if tracing.tracer is not None else None  # off: one check
        failure = None
        status = INTERNAL_STATUS  # until a response starts
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
                raise ClientBodyError(BODY_TIMEOUT_STATUS, "body_timeout", f"the request body did not arrive within "
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
                await send_error(self.apis.api(scope), send_with_id, error.status_code, error.type, error.detail,
                                 error.headers)
            else:
                await self.app(scope, limited_receive, send_with_id)
        except Exception as exc:
            failure = exc
            if response_started:
                raise  # a response is under way: only cutting the connection tells the client it is incomplete
            log.exception("unhandled error on %s", scope.get("path"))
            await send_error(self.apis.api(scope), send_with_id, INTERNAL_STATUS, INTERNAL_TYPE,
                             "internal error; see the server log")
        finally:
            for loaded in state.pop("leases", ()):  # the model versions the request resolved (serving.context)
                loaded.release()
            trace_id = None if span is None else span.end(scope, state, status, failure)
            self._observe(scope, state, status, time.perf_counter() - started, request_id, trace_id)

    def _too_large(self) -> ClientBodyError:
        return ClientBodyError(TOO_LARGE_STATUS, "payload_too_large",
                               f"request body exceeds {self.max_body_bytes} bytes (TSERVE_MAX_BODY_BYTES)")

    def _observe(self, scope, state, status: int, seconds: float, request_id: str,
                 trace_id: str | None = None) -> None:
        path = scope.get("path", "")
        route = self.apis.route(scope)
        endpoint = None if route is None else route.endpoint_label
        model, version, mode = state.get("model", ""), str(state.get("version", "")), state.get("mode", "")
        if endpoint is not None:
            self.metrics.count_request(endpoint=endpoint, api=route.api.name, model=model, version=version, mode=mode,
                                       status=status, seconds=seconds, failure_reason=state.get("failure_reason"))
        if route is None or route.api.access_log:
            logs.log_access(request_id=request_id, method=scope.get("method"), path=path, model=model or None,
                            version=int(version) if version else None, mode=mode or None, status=status,
                            latency_ms=logs.latency_ms(seconds), **({"trace_id": trace_id} if trace_id else {}))
