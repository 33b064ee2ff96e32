"""The interactive API docs (Swagger UI at ``/docs``, ReDoc at ``/redoc``), served with
their scripts and styles from this service, so that they work on a network without
internet access.

The asset files come from the ``fastapi-offline`` package (Swagger UI, Apache-2.0;
ReDoc, MIT), pinned in pyproject.toml. ReDoc's script shows a logo fetched from its
maker's CDN: the copy served here has that address replaced by an empty ``data:`` image,
which fails to load, so ReDoc leaves the logo out and nothing is fetched from elsewhere.
"""

from __future__ import annotations

import functools
import hashlib
import html
import json
from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from service.api.routing import SessionScopedRoute

ASSETS_URL = "/docs/assets"
_ASSETS_DIR = Path(fastapi_offline.__file__).parent / "static"

SWAGGER_INIT_URL = "/docs/swagger-init.js"
# Swagger UI sends the schema to an outside validator unless told not to; a token entered
# with Authorize stays in the page's memory only (never in the browser's localStorage).
_SWAGGER_PARAMETERS = {
    "validatorUrl": None,
    "persistAuthorization": False,
    "dom_id": "#swagger-ui",
    "layout": "BaseLayout",
    "deepLinking": True,
    "showExtensions": True,
    "showCommonExtensions": True,
}
# Swagger UI started by a script file of this service, not an inline one (the docs pages'
# Content-Security-Policy allows scripts of this origin only): the schema's URL is read
# from the page.
_SWAGGER_INIT = (
    "window.ui = SwaggerUIBundle(Object.assign("
    + json.dumps(_SWAGGER_PARAMETERS)
    + ", {url: document.getElementById('swagger-ui').dataset.openapiUrl,"
    " presets: [SwaggerUIBundle.presets.apis, SwaggerUIBundle.SwaggerUIStandalonePreset]}));\n"
)


def _swagger_page(title: str, openapi_url: str, assets: str, init_url: str) -> str:
    e = html.escape
    return f"""<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
<title>{e(title)}</title>
<link type="text/css" rel="stylesheet" href="{e(assets)}/swagger-ui.css">
<link rel="shortcut icon" href="{e(assets)}/favicon.png">
</head>
<body>
<div id="swagger-ui" data-openapi-url="{e(openapi_url)}"></div>
<script src="{e(assets)}/swagger-ui-bundle.js"></script>
<script src="{e(init_url)}"></script>
</body>
</html>
"""


REDOC_SCRIPT = "redoc.standalone.js"
# The logo ReDoc's menu shows (an <img> that hides itself when the image fails to load).
REDOC_LOGO_URL = b"https://cdn.redoc.ly/redoc/logo-mini.svg"


@functools.cache
def redoc_script() -> tuple[bytes, str]:
    """ReDoc's script without its CDN logo, and its ETag."""
    body = (_ASSETS_DIR / REDOC_SCRIPT).read_bytes().replace(REDOC_LOGO_URL, b"data:,")
    return body, '"' + hashlib.sha256(body).hexdigest()[:32] + '"'


def install_docs(app: FastAPI, *, docs_url: str = "/docs", redoc_url: str = "/redoc") -> None:
    """Serve the docs pages and their assets; create ``app`` with ``docs_url=None, redoc_url=None``."""

    def prefix(request: Request) -> str:
        root: str = request.scope.get("root_path", "")
        return root.rstrip("/")

    # Every route of the app is a SessionScopedRoute (tests/service/test_concurrency.py checks it).
    router = APIRouter(route_class=SessionScopedRoute)

    @router.get(docs_url, include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = prefix(request)
        page = _swagger_page(
            f"{app.title} - Swagger UI",
            f"{root}{app.openapi_url}",
            f"{root}{ASSETS_URL}",
            f"{root}{SWAGGER_INIT_URL}",
        )
        return HTMLResponse(page)

    @router.get(SWAGGER_INIT_URL, include_in_schema=False)
    async def swagger_init() -> Response:
        return Response(_SWAGGER_INIT, media_type="text/javascript")

    @router.get(redoc_url, include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = prefix(request)
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{root}{ASSETS_URL}/{REDOC_SCRIPT}",
            redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )

    # Before the assets' mount, which would otherwise answer with the unpatched file.
    @router.get(f"{ASSETS_URL}/{REDOC_SCRIPT}", include_in_schema=False)
    async def redoc_js(request: Request) -> Response:
        body, etag = redoc_script()
        headers = {"ETag": etag, "Cache-Control": "public, max-age=86400"}
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        return Response(body, media_type="text/javascript", headers=headers)

    app.include_router(router)
    app.mount(ASSETS_URL, StaticFiles(directory=_ASSETS_DIR), name="docs-assets")
