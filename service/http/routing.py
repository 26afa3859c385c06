"""What the API routers share to build their endpoints: `with_body`, an endpoint whose JSON body is validated as a
given request model (the app's own, built from its settings' limits: `service.api.native.protocol.request_models`),
and `sse_response`, a server-sent event stream (`service.client.sse.event` framing, `data: [DONE]` last) that
counts a client that leaves early as cancelled and closes the serving events either way.

Each API's router (`service.api.native`, `service.api.openai`, `service.api.oip`) builds its routes with these;
the APIs' error shapes and metrics labels are registered apart, through their route classes (`service.http.apis`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from service.client.sse import DONE
from service.client.sse import event as sse_event


# How a `with_body` route answers a body that is not declared JSON (`service.http.errors`), for its OpenAPI responses
NOT_JSON_STATUS = 415
NOT_JSON_DESCRIPTION = ("The body is not declared JSON: a Content-Type other than application/json (or "
                        "application/*+json), or a body sent without one; the message names what was sent")


def with_body(handler: Callable[..., Awaitable], body_model: type[BaseModel]) -> Callable[..., Awaitable]:
    """An endpoint for FastAPI that validates the JSON body as `body_model` and calls `handler(body, request)`;
    its errors table should document `NOT_JSON_STATUS`."""

    async def endpoint(body, request: Request):
        return await handler(body, request)

    endpoint.__annotations__ = {"body": body_model, "request": Request}  # what FastAPI reads to validate
    endpoint.__name__, endpoint.__doc__ = handler.__name__, handler.__doc__
    return endpoint


def sse_response(request: Request, chunks: AsyncIterator[bytes], events: AsyncIterator) -> StreamingResponse:
    """Server-sent events: an API's `chunks` (rendered from the serving layer's `events`), then [DONE]. A client that
    leaves before [DONE] is counted as cancelled (unless the stream already failed with a reason); the serving
    events are closed either way, which cancels whatever is left of the request."""

    async def body() -> AsyncIterator[bytes]:
        delivered = False
        try:
            async for chunk in chunks:
                yield chunk
            yield sse_event(DONE)
            delivered = True
        finally:
            if not delivered and not getattr(request.state, "failure_reason", None):  # the client went away
                request.state.failure_reason = "cancelled"
            await chunks.aclose()
            await events.aclose()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
