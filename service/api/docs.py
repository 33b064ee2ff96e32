"""The interactive API docs (Swagger UI at ``/docs``, ReDoc at ``/redoc``), served with
their scripts and styles from this service, so that they work on a network without
internet access.

The asset files come from the ``fastapi-offline`` package (Swagger UI, Apache-2.0;
ReDoc, MIT), pinned in pyproject.toml.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from service.api.routing import SessionScopedRoute

ASSETS_URL = "/docs/assets"
_ASSETS_DIR = Path(fastapi_offline.__file__).parent / "static"

# Swagger UI sends the schema to an outside validator unless told not to; the token
# entered with Authorize is kept across page reloads.
_SWAGGER_PARAMETERS = {"validatorUrl": None, "persistAuthorization": True}


def install_docs(app: FastAPI, *, docs_url: str = "/docs", redoc_url: str = "/redoc") -> None:
    """Serve the docs pages and their assets; create ``app`` with ``docs_url=None, redoc_url=None``."""
    app.mount(ASSETS_URL, StaticFiles(directory=_ASSETS_DIR), name="docs-assets")

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
            redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )

    app.include_router(router)
