"""The Open Inference Protocol's errors and what it registers with the HTTP shell (`service.http.apis`): the `api`
label "oip", its error shape `{"error": "..."}` (as the protocol says; a request that does not conform to the schema
is a 400), and the one `endpoint` label of its inference routes. Its metadata, health and repository routes are not
counted by the request metrics; a path under `/v2` that no route matches is answered in its shape.
"""

from __future__ import annotations

from service.http.apis import VALIDATION_STATUS, Api

# The protocol answers a request that does not conform to the schema with 400, not FastAPI's 422.
OIP_VALIDATION_STATUS = 400
# Where the protocol's paths live: an unmatched path at or under it is answered in the protocol's shape.
ROOT = "/v2"
# Inference names the model in the path (/v2/models/{name}[/versions/{version}]/infer): one label for both routes.
INFER_ENDPOINT = "/v2/models/{model}/infer"
INFER_SUFFIX = "/infer"


def oip_error(status: int, error_type: str, message: str, param: str | None = None) -> tuple[int, dict]:
    """(status, body) of an error in the protocol's shape."""
    return (OIP_VALIDATION_STATUS if status == VALIDATION_STATUS else status), {"error": message}


def endpoint_label(path: str) -> str | None:
    """The inference routes' one label; the protocol's other routes are not counted."""
    return INFER_ENDPOINT if path.endswith(INFER_SUFFIX) else None


OIP = Api("oip", render=oip_error, endpoint=endpoint_label, root=ROOT)
