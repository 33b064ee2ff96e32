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
from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from service.api.routing import SessionScopedRoute

ASSETS_URL = "/docs/assets"
_ASSETS_DIR = Path(fastapi_offline.__file__).parent / "static"

# Swagger UI sends the schema to an outside validator unless told not to; the token
# entered with Authorize is kept across page reloads.
_SWAGGER_PARAMETERS = {"validatorUrl": None, "persistAuthorization": True}

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
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            swagger_ui_parameters=_SWAGGER_PARAMETERS,
        )

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
