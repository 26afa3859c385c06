"""Server-sent events as the service writes them (`event`) and the project's clients read them back (the tests, the
HTTP benchmark, the locustfile): one `data: <JSON object>` line per event, a blank line after each, and
`data: [DONE]` last. Standard library only: the locust image copies this file without the rest of the package.

- `event(payload)`: one event as the server sends it (a JSON object, or a bare string such as [DONE]).
- `parse_sse(body)`: a complete response body -> its events. Strict about the framing: meant for checking the
  server's output.
- `SSEParser`: incremental, for streaming clients: feed it lines (`feed_line`, as httpx's and requests'
  `iter_lines` give them) or chunks of the body (`feed`), bytes or text, as they arrive, and get the events;
  `done` says whether `data: [DONE]` has come.
An event that is not a JSON object, or data after `[DONE]`, is an `SSEError` (a ValueError) in both.
"""

from __future__ import annotations

import json

__all__ = ["DONE", "SSEError", "SSEParser", "event", "parse_sse"]

DONE = "[DONE]"
_DATA = "data: "
_END = "\n\n"  # an event's line and the blank line after it
# How much of a bad event (its start) or of a bad body (its end, and its last events) an SSEError quotes.
_QUOTED_CHARS, _QUOTED_TAIL_CHARS, _QUOTED_EVENTS = 300, 200, 3


def event(payload) -> bytes:
    """One server-sent event: `data: <JSON>` (or a bare string such as [DONE]) and the blank line after it. Strict
    JSON (a non-finite number raises instead of writing NaN); a lone surrogate is written as its escape."""
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, allow_nan=False)
    return f"{_DATA}{text}{_END}".encode("utf-8", "backslashreplace")


class SSEError(ValueError):
    """A body, line or event that is not the service's server-sent event framing."""


def _event(data: str) -> dict:
    try:
        event = json.loads(data)
    except ValueError as error:
        raise SSEError(f"event is not JSON: {data[:_QUOTED_CHARS]!r}") from error
    if not isinstance(event, dict):
        raise SSEError(f"event is not a JSON object: {data[:_QUOTED_CHARS]!r}")
    return event


def parse_sse(body: str | bytes) -> list[dict]:
    """`data: {...}\\n\\n` events ending with `data: [DONE]\\n\\n` -> the events, without [DONE]. Anything else (no
    final [DONE], data after it, an event of several lines or with other fields, a missing blank line) raises
    SSEError."""
    text = body.decode("utf-8") if isinstance(body, bytes) else body
    if not text.endswith(_END):
        raise SSEError(f"the body does not end with a blank line: {text[-_QUOTED_TAIL_CHARS:]!r}")
    chunks = text[:-len(_END)].split(_END)
    if chunks[-1] != _DATA + DONE:
        raise SSEError(f"the body does not end with `data: [DONE]`: {chunks[-_QUOTED_EVENTS:]!r}")
    events = []
    for chunk in chunks[:-1]:
        if not chunk.startswith(_DATA) or "\n" in chunk:
            raise SSEError(f"not one `data: ` line: {chunk[:_QUOTED_CHARS]!r}")
        events.append(_event(chunk[len(_DATA):]))
    return events


class SSEParser:
    """Incremental parsing of a stream of the service's server-sent events.

    `feed_line(line)` returns the event a `data:` line carries, or None (for `data: [DONE]`, which sets `done`, and
    for blank separators, `:` comments and other fields). `feed(chunk)` takes any piece of the body, split anywhere,
    and returns the events of the lines it completes (a partial last line waits for the next chunk). Stop reading
    once `done` is set: a `data:` line after [DONE] is an SSEError."""

    def __init__(self) -> None:
        self.done = False
        self._partial: str | bytes | None = None

    def feed_line(self, line: str | bytes) -> dict | None:
        if isinstance(line, bytes):
            line = line.decode("utf-8")
        line = line.rstrip("\r\n")
        if not line.startswith("data:"):
            return None
        data = line[len("data:"):].removeprefix(" ")
        if self.done:
            raise SSEError(f"data after [DONE]: {data[:_QUOTED_CHARS]!r}")
        if data == DONE:
            self.done = True
            return None
        return _event(data)

    def feed(self, chunk: str | bytes) -> list[dict]:
        buffer = chunk if self._partial is None else self._partial + chunk
        *lines, self._partial = buffer.split(b"\n" if isinstance(buffer, bytes) else "\n")
        return [event for event in map(self.feed_line, lines) if event is not None]
