"""Limits on HTTP/1.1 request heads (request line + headers), enforced in uvicorn's protocol before the app runs.

`limited_http_protocol` returns a subclass of uvicorn's `HttpToolsProtocol` (uvicorn has no request-head timeout
and, with httptools, no bound on the size or number of headers) that enforces, per request: the head complete
within `header_timeout_s` (408), at most `max_header_bytes` long, counted as the bytes arrive (431), at most
`max_header_count` headers (431); a head the parser cannot read is a 400 naming the parser's reason. A rejected
connection gets a complete JSON error response; `on_reject(reason)` is called once per rejected connection.

Invariant: an answer is never turned into a TCP reset by closing at once. A rejected connection and a response sent
before its request's body arrived (413, 408) are half-closed and what the client still sends is read and discarded
(nginx's lingering close, bounded by `LINGER_S` and `LINGER_MAX_S`); at shutdown an idle keep-alive connection stays
open `SHUTDOWN_IDLE_GRACE_S` for a request already on its way (503 while draining).

Design notes: docs/architecture.md, service/http/limits.py.
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
BAD_REQUEST = "bad_request"
# A head that did not arrive in time (408), one too large or with too many headers (431), one not HTTP (400).
HEADER_TIMEOUT_STATUS, HEADERS_TOO_LARGE_STATUS, BAD_REQUEST_STATUS = 408, 431, 400
REJECT_REASONS = (HEADER_TIMEOUT, HEADERS_TOO_LARGE, TOO_MANY_HEADERS, BAD_REQUEST)
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
                    self._bad_request(error)
                return
            except httptools.HttpParserError as error:
                self._bad_request(error)
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

        def _bad_request(self, error: BaseException) -> None:
            self._reject(BAD_REQUEST_STATUS, BAD_REQUEST, unreadable_request(error))

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


def unreadable_request(error: BaseException) -> str:
    """What a 400 says of a request the parser could not read (`error`: httptools', or what a callback raised)."""
    reason = str(error.args[0]) if error.args else type(error).__name__
    hint = ""
    if isinstance(error, httptools.HttpParserInvalidURLError):  # e.g. a raw byte that is not ASCII in the path
        hint = "; a request target is ASCII: percent-encode any other byte (RFC 3986)"
    return f"not a valid HTTP/1.1 request: {reason}{hint}"


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
