"""Limits on HTTP/1.1 request heads (request line + headers), enforced in uvicorn's protocol before the app runs.

uvicorn has no request-head timeout (its keep-alive timer only runs between requests) and, with httptools, no
bound on the size or number of headers: a client trickling its head, or sending nothing, held a connection open
indefinitely, and a 1 MB header or 5,000 headers were buffered and handed to the app. `limited_http_protocol`
returns a subclass of uvicorn's `HttpToolsProtocol` that enforces, per request:

- the head must be complete within `header_timeout_s` of the connection opening (first request) or of the first
  byte of the next request on a keep-alive connection (408); an idle keep-alive connection is left to uvicorn's
  `timeout_keep_alive`;
- the head may be at most `max_header_bytes` long, counted as the bytes arrive, so that one huge header is
  stopped while it streams in rather than after it was buffered (431);
- at most `max_header_count` headers (431).

A rejected connection gets a complete JSON error response (`{"error": {"type", "message"}}`, `connection:
close`), is half-closed, and what the client still sends is read and discarded for at most `LINGER_S` before
the socket is closed: closing a socket with unread data sends a TCP reset, which can destroy the response
before the client reads it. If a response is in progress on the connection (pipelining), no second response is
written into it: the connection is closed once that response completes. `on_reject(reason)` is called once per
rejected connection (the metrics), and a warning is logged on `tserve.http` with the peer and the reason.

Two more places where closing at once would turn an answer into a TCP reset:

- A response sent before its request's body has arrived (a 413 for a body over the limit, chunked or not, a 408)
  ends with `connection: close`; uvicorn would close the socket while the client is still sending, and the reset
  destroys the 413 before the client reads it. The connection is half-closed instead and what the client still
  sends is read and discarded, as nginx's lingering close does: until the client closes, or `LINGER_S` passes
  without a byte, or `LINGER_MAX_S` in all.
- At shutdown uvicorn closes idle keep-alive connections at once, racing a request the client is sending on one
  (with `TSERVE_DRAIN_DELAY_S=0`, 6 of 762 such requests got a reset). An idle connection is kept for
  `SHUTDOWN_IDLE_GRACE_S` instead: a request that arrives is answered (503 while draining) with `connection:
  close`, and the connection closes after that response or at the end of the grace.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from service.http.apis import native_error
from service.settings import Settings

log = logging.getLogger("tserve.http")

# A lingering close (after a rejection, or a response sent before its body arrived) discards what the client still
# sends until it closes, or LINGER_S passes without a byte (nginx's lingering_timeout), or LINGER_MAX_S in all
# (nginx's lingering_time): bounded, so a client cannot hold the connection by sending forever.
LINGER_S = 2.0
LINGER_MAX_S = 30.0
# At shutdown, how long an idle keep-alive connection stays open for a request already on its way: well above a
# request's transit time, well below Kubernetes' 30 s termination grace.
SHUTDOWN_IDLE_GRACE_S = 1.0
HEADER_TIMEOUT, HEADERS_TOO_LARGE, TOO_MANY_HEADERS = "header_timeout", "headers_too_large", "too_many_headers"
# A head that did not arrive in time (408), one too large or with too many headers (431).
HEADER_TIMEOUT_STATUS, HEADERS_TOO_LARGE_STATUS = 408, 431
REJECT_REASONS = (HEADER_TIMEOUT, HEADERS_TOO_LARGE, TOO_MANY_HEADERS)
# bytes of a head that httptools' callbacks do not report: "<method> <url> HTTP/1.1\r\n" spaces and version,
# the final empty line, and per header ": " and "\r\n"
REQUEST_LINE_OVERHEAD = len(b"  HTTP/1.1\r\n") + len(b"\r\n")
HEADER_OVERHEAD = len(b": \r\n")


class _Rejected(Exception):
    """Raised from a parser callback once the head was rejected (and answered), to stop parsing the chunk."""


def limited_http_protocol(settings: Settings, on_reject: Callable[[str], None]) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol bound to the settings' head limits; pass it as `uvicorn.run(..., http=...)`."""
    timeout_s, max_bytes, max_count = settings.header_timeout_s, settings.max_header_bytes, settings.max_header_count

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._timer: asyncio.TimerHandle | None = None  # the head timeout, then the linger after a rejection
            self._in_head = False  # a request head has begun (or the connection opened) and is not complete yet
            self._rejected = False
            self._head_bytes = 0  # bytes received for the head in progress
            self._head_size = 0  # the head's size as the parser callbacks report it (url, headers)
            self._header_count = 0
            self._chunk_other = 0  # bytes of the chunk being parsed that belong to other messages (bodies, heads)
            self._lingering = False  # half-closed: what arrives is discarded until the client closes
            self._linger_ends = 0.0  # loop time at which a lingering close closes whatever the client does
            self._shutting_down = False  # the server is stopping: no more keep-alive on this connection
            self._grace: asyncio.TimerHandle | None = None  # an idle connection's close at the end of the grace

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._start_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timer()
            if self._grace is not None:
                self._grace.cancel()
            super().connection_lost(exc)

        def shutdown(self) -> None:
            # uvicorn's shutdown closes an idle connection at once; keep it for the grace (module docstring)
            self._shutting_down = True
            if self.cycle is None or self.cycle.response_complete:
                self._grace = self.loop.call_later(SHUTDOWN_IDLE_GRACE_S, self._close_if_idle)
            else:
                self.cycle.keep_alive = False

        def _close_if_idle(self) -> None:
            self._grace = None
            idle = self.cycle is None or self.cycle.response_complete
            if idle and not (self._in_head and self._head_bytes) and not self.transport.is_closing():
                self.transport.close()  # else a request is arriving or running: it closes after its response

        def data_received(self, data: bytes) -> None:
            # uvicorn's data_received, plus: rejections raised from the callbacks end parsing quietly, and the
            # bytes of an incomplete head are counted as they arrive
            if self._lingering:
                self._linger_for_more()
                return  # answered already: discard until the connection closes
            if self._rejected:
                return  # answered already: discard until the connection closes
            self._unset_keepalive_if_required()
            idle = self.cycle is None or (self.cycle.response_complete and not self.cycle.more_body)
            if idle and not self._in_head:
                self._start_head()  # the first byte of the next request on a keep-alive connection
            self._chunk_other = 0
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserCallbackError as error:
                if not isinstance(error.__context__, _Rejected):
                    self._bad_request()
                return
            except httptools.HttpParserError:
                self._bad_request()
                return
            except httptools.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
                return
            if self._in_head:
                self._head_bytes += len(data) - self._chunk_other
                if self._head_bytes > max_bytes:
                    self._reject_too_large()

        def _bad_request(self) -> None:
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)

        # parser callbacks
        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_bytes = self._head_size = self._header_count = 0
            if not self._in_head:
                self._start_head()  # pipelined after a request still in progress

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            self._head_size += len(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            self._head_size += len(name) + len(value) + HEADER_OVERHEAD
            if self._header_count > max_count:
                self._reject(HEADERS_TOO_LARGE_STATUS, TOO_MANY_HEADERS,
                             f"more than {max_count} request headers (TSERVE_MAX_HEADER_COUNT={max_count})")
                raise _Rejected
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._head_size += len(self.parser.get_method()) + REQUEST_LINE_OVERHEAD
            if self._head_size > max_bytes:  # a head that arrived in one chunk with the data after it
                self._reject_too_large()
                raise _Rejected
            self._in_head = False
            self._cancel_timer()
            self._chunk_other += self._head_size
            super().on_headers_complete()
            if self._shutting_down:
                self.cycle.keep_alive = False
            # uvicorn's cycle closes the transport after a `connection: close` response; route that close through
            # the lingering close in case the request's body is still arriving
            self.cycle.transport = _LingeringClose(self.transport, self.cycle, self._linger)

        def on_body(self, body: bytes) -> None:
            self._chunk_other += len(body)
            super().on_body(body)

        # the limits
        def _start_head(self) -> None:
            self._in_head, self._head_bytes = True, 0
            self._cancel_timer()
            self._timer = self.loop.call_later(timeout_s, self._head_timed_out)

        def _cancel_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _head_timed_out(self) -> None:
            self._timer = None
            self._reject(HEADER_TIMEOUT_STATUS, HEADER_TIMEOUT, f"request line and headers not received within "
                         f"{timeout_s:g} s (TSERVE_HEADER_TIMEOUT_S={timeout_s:g})")

        def _reject_too_large(self) -> None:
            self._reject(HEADERS_TOO_LARGE_STATUS, HEADERS_TOO_LARGE,
                         f"request line and headers over {max_bytes} bytes (TSERVE_MAX_HEADER_BYTES={max_bytes})")

        def _reject(self, status: int, reason: str, message: str) -> None:
            if self._rejected:
                return
            self._rejected, self._in_head = True, False
            self._cancel_timer()
            peer = f"{self.client[0]}:{self.client[1]}" if self.client else "unknown"
            log.warning("connection rejected: %s", reason, extra={"fields": {"peer": peer, "reason": reason}})
            on_reject(reason)
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.keep_alive = False  # a response is being written: close after it, write nothing
                return
            _, payload = native_error(status, reason, message)
            body = json.dumps(payload).encode()
            headers = [*self.server_state.default_headers, (b"content-type", b"application/json"),
                       (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
            self.transport.write(b"".join([STATUS_LINE[status], *(k + b": " + v + b"\r\n" for k, v in headers),
                                           b"\r\n", body]))
            self._linger()

        def _linger(self) -> None:
            """Half-close, then discard what the client still sends (the bounds: module docstring)."""
            if self.transport.is_closing():
                return
            if not self.transport.can_write_eof():
                self.transport.close()
                return
            self.transport.write_eof()
            self.flow.resume_reading()  # uvicorn pauses reading while a body waits for the app
            self._lingering = True
            self._linger_ends = self.loop.time() + LINGER_MAX_S
            self._cancel_timer()
            self._timer = self.loop.call_later(LINGER_S, self.transport.close)

        def _linger_for_more(self) -> None:
            """A chunk arrived while lingering: wait LINGER_S more for the next, within LINGER_MAX_S in all."""
            self._cancel_timer()
            self._unset_keepalive_if_required()  # uvicorn's keep-alive timer, armed after the response
            self._timer = self.loop.call_at(min(self.loop.time() + LINGER_S, self._linger_ends), self.transport.close)

    return LimitedHttpToolsProtocol


class _LingeringClose:
    """The transport as a request's cycle sees it: `close()` lingers (`linger`) while the request's body is still
    arriving, and closes at once otherwise; everything else is the transport's."""

    def __init__(self, transport: asyncio.Transport, cycle, linger: Callable[[], None]) -> None:
        self._transport, self._cycle, self._linger = transport, cycle, linger

    def close(self) -> None:
        if self._cycle.more_body:
            self._linger()
        else:
            self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)
