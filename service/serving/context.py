"""Per-request context every capability needs: the model version it runs on (held by a lease until the response
has ended: the request middleware releases it), the deadline, the labels the request middleware puts on the
request's metrics and access-log line, and the checks of one field against another that every text capability
makes (no request schema can state them).

The serving layer reads a request through `Caller`, whatever protocol carried it: a Starlette `Request` is one, a
gRPC call another (`service.api.oip.grpc.calls.GrpcCall`)."""

from __future__ import annotations

import time
from typing import Any, Protocol

from service.errors import BadInput
from service.models.registry import LoadedModel


class Caller(Protocol):
    """What the serving layer reads of a request: the app (`app.state`: settings, registry, request models, image
    decoder, metrics), the request's own `state` (its leases and labels, read when it ends), and whether its client
    is still there."""

    app: Any
    state: Any

    async def is_disconnected(self) -> bool: ...


def resolve(request: Caller, kind: str | None, name: str | None, version: int | None) -> LoadedModel:
    """The loaded model version the request asks for (see `ModelRegistry.resolve`), leased for the request."""
    loaded = request.app.state.registry.resolve(kind, name, version)
    loaded.acquire()
    request.state.leases = [*getattr(request.state, "leases", []), loaded]
    return loaded


def deadline_of(request: Caller, timeout_ms: int | None) -> float:
    """time.monotonic() seconds at which the request's deadline passes (its own, or the server's default)."""
    return time.monotonic() + (timeout_ms or request.app.state.settings.default_timeout_ms) / 1000.0


def priority_level(loaded: LoadedModel, priority: int | None) -> int:
    """The queue level of a request to `loaded` (`service.scheduling.priority`): its own, else the model's default;
    400 naming `priority` outside the levels."""
    return loaded.scheduler.priority.level(priority)


def label(request: Caller, loaded: LoadedModel, mode: str) -> None:
    """The model, version and decoding mode this request's metrics and log line are labelled with."""
    request.state.model, request.state.version, request.state.mode = loaded.name, loaded.version, mode


def check_new_tokens(min_new_tokens: int, max_new_tokens: int | None) -> None:
    """400 when the tokens that must be generated are more than the most that may be (None: no maximum given)."""
    if max_new_tokens is not None and min_new_tokens > max_new_tokens:
        raise BadInput(f"min_new_tokens ({min_new_tokens}) must be <= max_new_tokens ({max_new_tokens})",
                       param="min_new_tokens")
