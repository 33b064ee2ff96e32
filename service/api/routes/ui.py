"""The web UI: its page and assets (shipped in ``service/ui/static``), and signing in and out.

The page is one HTML file; the app itself is plain JavaScript modules that call the same
``/v1`` routes as every other client, authenticated by the sign-in cookie (see
``service/api/security.py``). Nothing is fetched from another origin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from pydantic import Field

from service.api.routing import SessionScopedRoute
from service.api.security import SESSION_COOKIE
from service.db.engine import Database
from service.schemas.common import StrictModel
from service.schemas.tokens import WhoAmI
from service.services.tokens import authenticate
from service.services.web_sessions import is_session_value, revoke_session
from service.states import Role
from torchyard.contract.errors import PermissionDeniedError

STATIC_DIR = Path(__file__).resolve().parents[2] / "ui" / "static"
ASSETS_URL = "/ui"
# The app's assets change only with the package: a browser may keep them for an hour.
_ASSET_CACHE = "public, max-age=3600"

router = APIRouter(route_class=SessionScopedRoute)


class SessionCreate(StrictModel):
    token: str = Field(min_length=1, max_length=500, description="A user or admin token.")


@router.get("/", include_in_schema=False)
def index() -> FileResponse:
    """The web app's page (every path of the app is a ``#/...`` fragment of it)."""
    return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


@router.post("/v1/session", tags=["tokens"])
def sign_in(body: SessionCreate, request: Request, response: Response) -> WhoAmI:
    """Sign the web UI in: the token is checked and set in an HttpOnly, SameSite=Strict
    cookie (Secure over HTTPS) that page scripts cannot read. Worker tokens are refused."""
    db: Database = request.app.state.db
    with db.read_session() as session:
        principal = authenticate(session, body.token.strip())
    # Who signed in, for the audit trail's auth.sign_in (a refused worker token included).
    request.state.principal = principal
    if principal.role not in (Role.USER, Role.ADMIN):
        raise PermissionDeniedError("worker tokens cannot sign in to the web UI")
    response.set_cookie(
        SESSION_COOKIE,
        body.token.strip(),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )
    response.headers["Cache-Control"] = "no-store"
    return WhoAmI(id=principal.id, name=principal.name, role=principal.role)


@router.delete("/v1/session", tags=["tokens"], status_code=204)
def sign_out(request: Request) -> Response:
    """Sign the web UI out: the cookie is cleared (the token itself stays valid; a sign-in
    through the OpenID provider is revoked, as ``POST /auth/logout`` does)."""
    value = request.cookies.get(SESSION_COOKIE, "").strip()
    if is_session_value(value):
        db: Database = request.app.state.db
        with db.session() as session:
            if revoke_session(session, value):
                session.commit()
    response = Response(status_code=204)
    response.delete_cookie(
        SESSION_COOKIE, path="/", httponly=True, samesite="strict", secure=request.url.scheme == "https"
    )
    return response


class _Assets(StaticFiles):
    """The UI's static files, with a cache lifetime and never a directory listing."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = _ASSET_CACHE
        return response


def install_ui(app: FastAPI) -> None:
    app.mount(ASSETS_URL, _Assets(directory=STATIC_DIR), name="ui-assets")
    app.include_router(router)
