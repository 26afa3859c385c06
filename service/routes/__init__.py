"""HTTP routers, one per concern: text (translate, generate), images (classify), admin (models, health, metrics).

The text and image routers are built per app (`build_router(models)`), because their request bodies are the app's
own request models, whose limits come from its settings (`service.protocol.request_models`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request
from pydantic import BaseModel


def with_body(handler: Callable[..., Awaitable], body_model: type[BaseModel]) -> Callable[..., Awaitable]:
    """An endpoint for FastAPI that validates the JSON body as `body_model` and calls `handler(body, request)`."""

    async def endpoint(body, request: Request):
        return await handler(body, request)

    endpoint.__annotations__ = {"body": body_model, "request": Request}  # what FastAPI reads to validate
    endpoint.__name__, endpoint.__doc__ = handler.__name__, handler.__doc__
    return endpoint
