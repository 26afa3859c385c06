"""The OpenAI-compatible API's errors and what it registers with the HTTP shell (`service.http.apis`): the `api`
label "openai", every route counted under its own path, and OpenAI's error shape.

OpenAI's shape is `{"error": {"message", "type", "param", "code"}}`, a superset of the service's own: `type` is
OpenAI's error type for the status (the SDK maps the status to its exception class; the type is for people),
`code` holds this service's error type (`model_not_found` for a model id `GET /v1/models/{model}` does not know, as
OpenAI's). A request that does not conform to the schema is a 400, as OpenAI answers it. A stream that fails after
its status was sent ends with an error event of the same type (`openai_error_type`).
"""

from __future__ import annotations

from service.errors import NotFound
from service.http.apis import VALIDATION_STATUS, Api

# OpenAI answers a request that does not conform to the schema with 400, not FastAPI's 422.
OPENAI_VALIDATION_STATUS = 400
# OpenAI's error types by status; any other 5xx is a server_error, any other status an invalid_request_error.
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
                 415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                 503: "service_unavailable_error", 504: "timeout_error"}
SERVER_ERRORS_FROM = 500


class ModelNotFound(NotFound):
    """A model id that no model of the repository has, as OpenAI's `models.retrieve` answers it (404, its code)."""

    type = "model_not_found"


def openai_error_type(status: int) -> str:
    """OpenAI's error type for a status: the one mapping for every OpenAI error, streamed or not."""
    return _OPENAI_TYPES.get(status, "server_error" if status >= SERVER_ERRORS_FROM else "invalid_request_error")


def openai_error(status: int, error_type: str, message: str, param: str | None = None) -> tuple[int, dict]:
    """(status, body) of an error in OpenAI's shape."""
    if status == VALIDATION_STATUS:
        status = OPENAI_VALIDATION_STATUS
    return status, {"error": {"message": message, "type": openai_error_type(status), "param": param,
                              "code": error_type}}


OPENAI = Api("openai", render=openai_error)
