"""HTTP content codings (RFC 9110 section 8.4): compressed request bodies decoded, responses compressed when asked.

Requests: a body with `Content-Encoding: gzip` (or `x-gzip`) or `deflate` (the zlib format, RFC 1950) reaches every
route that reads a body decoded, inflated incrementally as it arrives (`DecodedBody`); a stream that does not decode
is a 400, any other coding a 415 with `Accept-Encoding: gzip, deflate` (RFC 7694), each a `ClientBodyError` in the
shape of the request's API. Responses: gzip or deflate, whichever the client's `Accept-Encoding` weights highest
(gzip on a tie), when the body is at least `MIN_COMPRESSED_BYTES`, by Starlette's GZip responders, which never touch
`text/event-stream`.

Invariant: the decoded size is held to the body limit of the received bytes (`TSERVE_MAX_BODY_BYTES`): a small gzip
bomb gets 413 once its decoded bytes pass the limit, having never held more than the limit in memory.

Design notes: docs/architecture.md, service/http/compression.py.
"""

from __future__ import annotations

import asyncio
import re
import zlib

from starlette.datastructures import Headers
from starlette.middleware.gzip import GZipResponder, IdentityResponder

from service.http.errors import ClientBodyError

# Each receive hands the route at most this much decoded body: zlib inflates a few hundred MB/s, so one step holds
# the event loop for a few milliseconds, and a large body is decoded between other requests' work.
DECODE_STEP_BYTES = 1 << 20
# The request codings, as zlib's window bits: gzip's header and trailer (16 + MAX_WBITS) or zlib's (MAX_WBITS).
REQUEST_CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
CODING_ALIASES = {"x-gzip": "gzip"}  # RFC 9110 section 8.4.1.3: a recipient should treat x-gzip as gzip
IDENTITY = "identity"
SUPPORTED = ", ".join(REQUEST_CODINGS)  # the 415's Accept-Encoding header and message
# The errors: a body too large once decoded, one that does not decode, a coding that is not supported.
TOO_LARGE_STATUS, INVALID_STATUS, UNSUPPORTED_STATUS = 413, 400, 415
TOO_LARGE_TYPE, INVALID_TYPE, UNSUPPORTED_TYPE = ("payload_too_large", "invalid_content_encoding",
                                                  "unsupported_content_encoding")

# A smaller response is sent as it is: it fits one TCP segment (an MSS is about 1,460 bytes) either way, so
# compressing it saves no round trip and costs CPU; 1,000 bytes is also where CloudFront starts compressing.
MIN_COMPRESSED_BYTES = 1000
# zlib's default level: most of level 9's ratio on JSON for a fraction of its CPU time.
COMPRESS_LEVEL = 6
# The response codings, in the order that breaks a tie between equal weights.
RESPONSE_CODINGS = ("gzip", "deflate")
# A weight (RFC 9110 section 12.4.2): 0 to 1 with at most three decimals; anything else counts as 0.
_QVALUE = re.compile(r"^(0(\.\d{0,3})?|1(\.0{0,3})?)$")


class DeflateResponder(GZipResponder):
    """Starlette's gzip responder writing the zlib format instead: `Content-Encoding: deflate`."""

    content_encoding = "deflate"

    @property
    def compressor(self):
        if self._compressor is None:
            self._compressor = zlib.compressobj(self.compresslevel, zlib.DEFLATED, zlib.MAX_WBITS)
        return self._compressor


RESPONDERS = {"gzip": GZipResponder, "deflate": DeflateResponder}


class ContentCodingMiddleware:
    """Decodes coded request bodies and compresses responses (module docstring); `max_body_bytes` is the limit
    of a decoded body."""

    def __init__(self, app, max_body_bytes: int, minimum_size: int = MIN_COMPRESSED_BYTES,
                 compress_level: int = COMPRESS_LEVEL):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.minimum_size = minimum_size
        self.compress_level = compress_level

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        codings = request_codings(headers.getlist("content-encoding"))
        if codings:
            receive = self._decoding(receive, codings)
            scope["headers"] = [(name, value) for name, value in scope["headers"]
                                if name not in (b"content-encoding", b"content-length")]
        coding = response_coding(headers.get("accept-encoding", ""))
        if coding is None:
            responder = IdentityResponder(self.app, self.minimum_size)
        else:
            responder = RESPONDERS[coding](self.app, self.minimum_size, compresslevel=self.compress_level)
        await responder(scope, receive, send)

    def _decoding(self, receive, codings: list[str]):
        unsupported = [c for c in codings if c not in REQUEST_CODINGS]
        if unsupported or len(codings) > 1:
            what = (f"Content-Encoding {', '.join(unsupported)!r} is not supported" if unsupported
                    else f"more than one content coding ({', '.join(codings)}) is not supported")
            return _refusing(ClientBodyError(UNSUPPORTED_STATUS, UNSUPPORTED_TYPE,
                                             f"{what}: send the body as one of {SUPPORTED}, or {IDENTITY}"))
        return DecodedBody(receive, codings[0], self.max_body_bytes)


def request_codings(values: list[str]) -> list[str]:
    """The codings a request's Content-Encoding header(s) list, in the order applied, lower-cased, aliases
    resolved, `identity` left out."""
    names = (name.strip().lower() for value in values for name in value.split(","))
    return [CODING_ALIASES.get(name, name) for name in names if name and name != IDENTITY]


def response_coding(accept_encoding: str) -> str | None:
    """The coding to answer in: the one of `RESPONSE_CODINGS` that Accept-Encoding weights highest (`*` stands for
    those it does not name; a tie goes to the first), or None when it accepts neither."""
    weights = {}
    for item in accept_encoding.split(","):
        name, _, parameters = item.partition(";")
        weight = 1.0
        for parameter in parameters.split(";"):
            key, _, value = parameter.partition("=")
            if key.strip().lower() == "q":
                weight = float(value) if _QVALUE.match(value.strip()) else 0.0
        if name.strip():
            weights[name.strip().lower()] = weight
    default = weights.get("*", 0.0)
    best = max(RESPONSE_CODINGS, key=lambda coding: weights.get(coding, default))  # a tie: the first
    return best if weights.get(best, default) > 0 else None


def _refusing(error: ClientBodyError):
    """A receive channel that refuses the body: `error` on the first read, before any of it is read."""
    error.headers["Accept-Encoding"] = SUPPORTED

    async def receive():
        raise error

    return receive


class DecodedBody:
    """The ASGI receive channel of a request whose body is coded: the decoded body, in steps of at most
    `step_bytes`, held to `max_bytes`; messages after the body (a disconnect) pass through."""

    def __init__(self, receive, coding: str, max_bytes: int, step_bytes: int = DECODE_STEP_BYTES):
        self._receive, self._coding, self._max, self._step = receive, coding, max_bytes, step_bytes
        self._decoder = zlib.decompressobj(REQUEST_CODINGS[coding])
        self._pending = b""  # coded bytes received and not decoded yet
        self._coded = 0  # coded bytes received
        self._decoded = 0  # decoded bytes handed over
        self._arrived = False  # the coded body has arrived whole
        self._done = False  # the decoded body has been handed over whole

    async def __call__(self) -> dict:
        if self._done:
            return await self._receive()
        if self._pending:
            await asyncio.sleep(0)  # still decoding what arrived: let the event loop run between steps
        else:
            message = await self._receive()
            if message["type"] != "http.request":
                return message
            self._pending = message.get("body", b"")
            self._coded += len(self._pending)
            self._arrived = not message.get("more_body", False)
        body = self._decode_step() if self._pending else b""
        self._done = self._arrived and not self._pending
        if self._done and self._coded and not self._decoder.eof:
            raise self._invalid("the stream ends before its end (truncated)")
        return {"type": "http.request", "body": body, "more_body": not self._done}

    def _decode_step(self) -> bytes:
        if self._decoder.eof:  # data after the end of a stream: gzip's next member (RFC 1952), else an error
            if self._coding != "gzip":
                raise self._invalid(f"data after the end of the {self._coding} stream")
            self._decoder = zlib.decompressobj(REQUEST_CODINGS[self._coding])
        try:
            # one byte over the limit is enough to know the body is too large
            body = self._decoder.decompress(self._pending, min(self._step, self._max - self._decoded + 1))
        except zlib.error as error:
            raise self._invalid(str(error)) from None
        self._pending = self._decoder.unused_data if self._decoder.eof else self._decoder.unconsumed_tail
        self._decoded += len(body)
        if self._decoded > self._max:
            raise ClientBodyError(TOO_LARGE_STATUS, TOO_LARGE_TYPE, f"request body exceeds {self._max} bytes once "
                                  f"decoded from {self._coding} (TSERVE_MAX_BODY_BYTES)")
        return body

    def _invalid(self, reason: str) -> ClientBodyError:
        return ClientBodyError(INVALID_STATUS, INVALID_TYPE,
                               f"body: not a valid {self._coding} stream (Content-Encoding: {self._coding}): {reason}")
