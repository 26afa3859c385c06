"""Per-request context every capability needs: the model version it runs on (held by a lease until the response
has ended: the request middleware releases it), the deadline, the labels the request middleware puts on the
request's metrics and access-log line, and the checks of one field against another that every text capability
makes (no request schema can state them)."""

from __future__ import annotations

import time

from fastapi import Request

from service.errors import BadInput
from service.models.registry import LoadedModel


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


def check_new_tokens(min_new_tokens: int, max_new_tokens: int | None) -> None:
    """400 when the tokens that must be generated are more than the most that may be (None: no maximum given)."""
    if max_new_tokens is not None and min_new_tokens > max_new_tokens:
        raise BadInput(f"min_new_tokens ({min_new_tokens}) must be <= max_new_tokens ({max_new_tokens})",
                       param="min_new_tokens")
