"""The API's documentation pages, served without internet: `/docs` (Swagger UI) and `/redoc` (ReDoc) are FastAPI's
own pages (`get_swagger_ui_html`, `get_redoc_html`, the schema at `/openapi.json`) with their scripts, styles and
icon served by the service itself, under `ASSETS_PATH`, from the fastapi-offline package.

fastapi-offline ships Swagger UI 5 and ReDoc 2's standalone bundle as they are published, refreshed in its releases
(1.7.7: Swagger UI 5.32, ReDoc 2.3.9), and depends on FastAPI alone; its `FastAPIOffline` factory is not used, only
its static folder, so the app is built as any other. A Content-Security-Policy keeps each page on the service:
scripts, styles, images, fonts and requests from the service alone (ReDoc's sidebar shows a logo from its CDN,
which is then not fetched; it hides an image that does not load). Swagger UI's online validator badge is off.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

DOCS_PATH, REDOC_PATH = "/docs", "/redoc"
ASSETS_PATH = "/docs/assets"
ASSETS = Path(fastapi_offline.__file__).parent / "static"  # the package's folder, and its files:
SWAGGER_JS, SWAGGER_CSS, REDOC_JS = "swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js"
FAVICON = "favicon.png"
# Swagger UI posts the schema to an online validator by default (a badge in its footer): off.
SWAGGER_UI_PARAMETERS = {"validatorUrl": None}
# Both pages load their bundle and run one inline script (Swagger UI's set-up; ReDoc's styles are inline, its
# search runs in a blob: worker, its icons are data: URLs); nothing may come from elsewhere.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
                           "img-src 'self' data:; worker-src 'self' blob:; connect-src 'self'")


def install_docs(app: FastAPI) -> None:
    """Serve `/docs`, `/redoc` and their assets on `app` (built with `docs_url=None, redoc_url=None`)."""
    app.mount(ASSETS_PATH, StaticFiles(directory=ASSETS), name="docs-assets")

    def url(request: Request, path: str) -> str:
        return request.scope.get("root_path", "").rstrip("/") + path  # behind a proxy's path prefix too

    def secured(page: HTMLResponse) -> HTMLResponse:
        page.headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        return page

    async def swagger_ui(request: Request) -> HTMLResponse:
        return secured(get_swagger_ui_html(
            openapi_url=url(request, app.openapi_url), title=f"{app.title} - Swagger UI", oauth2_redirect_url=None,
            swagger_js_url=url(request, f"{ASSETS_PATH}/{SWAGGER_JS}"),
            swagger_css_url=url(request, f"{ASSETS_PATH}/{SWAGGER_CSS}"),
            swagger_favicon_url=url(request, f"{ASSETS_PATH}/{FAVICON}"),
            swagger_ui_parameters={**(app.swagger_ui_parameters or {}), **SWAGGER_UI_PARAMETERS}))

    async def redoc(request: Request) -> HTMLResponse:
        return secured(get_redoc_html(
            openapi_url=url(request, app.openapi_url), title=f"{app.title} - ReDoc",
            redoc_js_url=url(request, f"{ASSETS_PATH}/{REDOC_JS}"),
            redoc_favicon_url=url(request, f"{ASSETS_PATH}/{FAVICON}"), with_google_fonts=False))

    app.add_api_route(DOCS_PATH, swagger_ui, methods=["GET"], include_in_schema=False)
    app.add_api_route(REDOC_PATH, redoc, methods=["GET"], include_in_schema=False)
