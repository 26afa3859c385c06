"""What each API registers with the HTTP shell, and how a request finds its API: from its route, never its URL.

An `Api` (native, OpenAI-compatible, Open Inference Protocol, operations) is its name (the metrics' `api` label),
its error renderer (the shape of its error bodies), the `endpoint` label of each of its routes (None: a route the
request metrics do not count), whether its requests go to the access log, and the path `root` whose unmatched paths
take its error shape. A router registers its API by building its routes with the API's route class
(`APIRouter(route_class=NATIVE.route_class)`); FastAPI puts the route that matched in `scope["route"]` (on a 405
too), where `ApiTable` reads it for the error handlers (`service.http.errors`) and the request middleware
(`service.http.middleware`).

A request answered before routing (a rejected API key, a declared body over the limit) has no route in its scope:
`ApiTable` matches the routes itself, as routing would. A path that no route matches (404) takes the shape of the
API whose `root` holds it (the Open Inference Protocol's `/v2`), else the native shape; the request metrics do not
count it (their `endpoint` label stays bounded, whatever paths clients send).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

from fastapi import APIRouter
from fastapi.routing import APIRoute
from starlette.routing import Match, get_route_path

# (status, error type, message, param) -> (status as sent, JSON body): the shape of one API's errors. The message
# and param come printable (`service.errors.printable`); the renderer may change the status (OpenAI: 422 -> 400).
ErrorRenderer = Callable[[int, str, str, str | None], tuple[int, dict]]
# What FastAPI answers a request that does not conform to its schema with (an API's renderer may answer 400).
VALIDATION_STATUS = 422


def native_error(status: int, error_type: str, message: str, param: str | None = None) -> tuple[int, dict]:
    """The service's own shape, `{"error": {"type", "message"}}`: the native API's, and the default."""
    return status, {"error": {"type": error_type, "message": message}}


def own_path(path: str) -> str:
    """A route's endpoint label as most routes have it: its path template."""
    return path


def not_counted(path: str) -> None:
    """No endpoint label: the request metrics do not count the route's requests."""
    return None


@dataclass(frozen=True, eq=False)
class Api:
    """One API as the HTTP shell sees it; its routers build their routes with `route_class`."""

    name: str  # the `api` label of the request metrics
    render: ErrorRenderer = native_error
    endpoint: Callable[[str], str | None] = own_path  # route path template -> its `endpoint` label, or None
    access_log: bool = True
    root: str | None = None  # unmatched paths at or under it take this API's error shape

    @cached_property
    def route_class(self) -> type[ApiRoute]:
        """The route class its routers build their routes with: `APIRouter(route_class=api.route_class)`."""
        return type(f"{self.name.title()}Route", (ApiRoute,), {"api": self})

    def holds(self, path: str) -> bool:
        return self.root is not None and (path == self.root or path.startswith(self.root + "/"))


class ApiRoute(APIRoute):
    """A FastAPI route that knows its API (`api`, set on each API's subclass) and its `endpoint` label."""

    api: Api

    def __init__(self, path: str, endpoint: Callable, **kwargs):
        super().__init__(path, endpoint, **kwargs)
        self.endpoint_label = self.api.endpoint(self.path)


# The native API (/v1/translate, /v1/generate, /v1/classify): every route counted under its own path.
NATIVE = Api("native")
# Liveness, readiness and the metrics: polled all the time, so neither counted nor access-logged.
OPERATIONS = Api("operations", endpoint=not_counted, access_log=False)


class ApiTable:
    """The APIs of an app's routers: which route and API a request is for."""

    def __init__(self, routers: Iterable[APIRouter]):
        self.routes = [route for router in routers for route in router.routes if isinstance(route, ApiRoute)]
        self.rooted = list(dict.fromkeys(route.api for route in self.routes if route.api.root is not None))

    def route(self, scope) -> ApiRoute | None:
        """The route that routing chose, else the one it would choose (a full match first, else a partial one: a
        405); None for a path of no API's route."""
        if "route" in scope:
            chosen = scope["route"]
            return chosen if isinstance(chosen, ApiRoute) else None
        partial = None
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                return route
            if match is Match.PARTIAL and partial is None:
                partial = route
        return partial

    def api(self, scope) -> Api:
        """The API whose error shape answers the request."""
        route = self.route(scope)
        if route is not None:
            return route.api
        path = get_route_path(scope)
        return next((api for api in self.rooted if api.holds(path)), NATIVE)
