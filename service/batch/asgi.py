"""The service's own FastAPI app run in-process, with no socket: `running_app(settings)` starts it with its lifespan
(the models loaded as `python -m service` loads them, their schedulers running) and `post(app, path, body)` hands a
request to it as uvicorn would (one ASGI `http` call), returning the status, headers and body it answered.

A request's receive channel gives the body, then waits until the response has ended before it reports the client
gone, as a connection that stays open does: the routes poll for a disconnect (`service.serving.awaiting`), and an
early one would cancel the request. (httpx's `ASGITransport` does the same; the serving install has no httpx.)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI

from service.app import create_app
from service.settings import Settings

log = logging.getLogger(__name__)

LOAD_POLL_S = 0.1  # how often the start waits for the model loader (loading takes seconds; a start is done once)
SERVER = ("in-process", 0)  # the scope's server and client: no socket, nothing to name but the process
CLIENT = ("service.batch", 0)
JSON_HEADERS = [(b"content-type", b"application/json")]


@dataclass(frozen=True)
class Answer:
    """What the app answered one request: the status, the headers (lower-case names) and the whole body."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


@asynccontextmanager
async def running_app(settings: Settings) -> AsyncIterator[FastAPI]:
    """`async with running_app(settings) as app:` the app, its lifespan entered and every configured model's load
    finished (loaded, or failed with its reason in the registry's `errors`); the lifespan is left on the way out
    (schedulers drained, sessions freed)."""
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        registry = app.state.registry
        while registry.pending:
            await asyncio.sleep(LOAD_POLL_S)
        yield app


async def post(app: FastAPI, path: str, body: bytes, headers: list[tuple[bytes, bytes]] = JSON_HEADERS) -> Answer:
    """POST `body` to `path` through the whole app (middleware, routing, error handlers) and read the answer; a
    streamed answer is read to its end."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [*headers, (b"content-length", str(len(body)).encode())], "server": SERVER, "client": CLIENT}
    ended = asyncio.Event()
    sent_body = False
    start: dict = {}
    chunks: list[bytes] = []

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await ended.wait()  # the client stays until the response has ended
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                ended.set()

    try:
        await app(scope, receive, send)
    finally:
        ended.set()
    headers_out = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in start.get("headers", [])}
    return Answer(start["status"], headers_out, b"".join(chunks))
