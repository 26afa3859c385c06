"""Per-request context every capability needs: the model version it runs on (held by a lease until the response
has ended: the request middleware releases it), the deadline, and the labels the request middleware puts on the
request's metrics and access-log line."""

from __future__ import annotations

import time

from fastapi import Request

from service.registry import LoadedModel


def resolve(request: Request, kind: str | None, name: str | None, version: int | None) -> LoadedModel:
    """The loaded model version the request asks for (see `ModelRegistry.resolve`), leased for the request."""
    loaded = request.app.state.registry.resolve(kind, name, version)
    loaded.acquire()
    request.state.leases = [*getattr(request.state, "leases", []), loaded]
    return loaded


def deadline_of(request: Request, timeout_ms: int | None) -> float:
    """time.monotonic() seconds at which the request's deadline passes (its own, or the server's default)."""
    return time.monotonic() + (timeout_ms or request.app.state.settings.default_timeout_ms) / 1000.0


def label(request: Request, loaded: LoadedModel, mode: str) -> None:
    """The model, version and decoding mode this request's metrics and log line are labelled with."""
    request.state.model, request.state.version, request.state.mode = loaded.name, loaded.version, mode
