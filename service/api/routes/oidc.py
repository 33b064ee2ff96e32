"""Sign-in with the organisation's OpenID provider (docs/oidc.md): the web UI's authorization
code flow with PKCE, sign-out, and the public configuration clients read.

``GET /auth/oidc/login`` keeps the request's state, nonce and PKCE verifier in a short-lived
cookie, encrypted and authenticated (Fernet, the webhook secrets' key), and sends the browser
to the provider; ``GET /auth/oidc/callback`` checks the state, exchanges the code, checks the
ID token and its nonce, finds or makes the user (issuer + subject) and sets the session
cookie: HttpOnly, SameSite=Lax, Secure when the public URL is https.
"""

from __future__ import annotations

import hmac
import json
from typing import Annotated, Any

from authlib.common.security import generate_token
from cryptography.fernet import InvalidToken
from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import RedirectResponse
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.api.routing import SessionScopedRoute
from service.api.security import SESSION_COOKIE
from service.config import Settings
from service.db.engine import Database
from service.services import audit
from service.services.oidc import OidcProvider, principal_of, sync_user
from service.services.tokens import Principal
from service.services.web_sessions import create_session, is_session_value, revoke_session
from service.services.webhooks import fernet
from torchyard.contract.errors import AuthenticationError, NotFoundError, RequestValidationError

LOGIN_COOKIE = "torchyard_oidc_login"
LOGIN_TTL_S = 600

router = APIRouter(tags=["sign-in"], route_class=SessionScopedRoute)


def _provider(request: Request) -> OidcProvider:
    provider: OidcProvider | None = getattr(request.app.state, "oidc", None)
    if provider is None:
        raise NotFoundError("sign-in with an OpenID provider is not set up here (TORCHYARD_OIDC_ISSUER)")
    return provider


def _settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def _secure(settings: Settings) -> bool:
    return (settings.public_url or "").startswith("https://")


@router.get("/auth/oidc/config")
def oidc_config(request: Request) -> dict[str, Any]:
    """Whether users sign in with an OpenID provider, and what a client needs to: the issuer,
    the CLI's (public) client id and the device authorization endpoint. No token needed."""
    provider: OidcProvider | None = getattr(request.app.state, "oidc", None)
    if provider is None:
        return {"enabled": False}
    return provider.public_config()


@router.get("/auth/oidc/login", include_in_schema=False)
def login(request: Request) -> RedirectResponse:
    """Start the web UI's sign-in: to the provider, with PKCE, state and nonce."""
    provider = _provider(request)
    settings = _settings(request)
    state, nonce, verifier = generate_token(32), generate_token(32), generate_token(64)
    url = provider.authorization_url(state, nonce, verifier)
    sealed = fernet(settings).encrypt(json.dumps({"s": state, "n": nonce, "v": verifier}).encode()).decode()
    response = RedirectResponse(url, status_code=303)
    response.set_cookie(
        LOGIN_COOKIE,
        sealed,
        max_age=LOGIN_TTL_S,
        path="/auth/oidc",
        httponly=True,
        samesite="lax",
        secure=_secure(settings),
    )
    response.headers["Cache-Control"] = "no-store"
    return response


@router.get("/auth/oidc/callback", include_in_schema=False)
def callback(
    request: Request,
    code: Annotated[str | None, Query(max_length=2000)] = None,
    state: Annotated[str | None, Query(max_length=500)] = None,
    error: Annotated[str | None, Query(max_length=200)] = None,
    error_description: Annotated[str | None, Query(max_length=1000)] = None,
) -> RedirectResponse:
    """The provider's answer: the state checked, the code exchanged, the ID token checked; the
    user signed in and sent to the web UI."""
    provider = _provider(request)
    settings = _settings(request)
    if error is not None:
        raise AuthenticationError(
            f"the OpenID provider refused the sign-in: {error} {error_description or ''}".strip()
        )
    sealed = request.cookies.get(LOGIN_COOKIE)
    if not sealed:
        raise RequestValidationError(
            "no sign-in in progress in this browser (or it took too long): start again"
        )
    try:
        kept = json.loads(fernet(settings).decrypt(sealed.encode(), ttl=LOGIN_TTL_S))
    except (InvalidToken, ValueError):
        raise RequestValidationError("the sign-in expired or its cookie was altered: start again") from None
    if not state or not hmac.compare_digest(state, str(kept.get("s", ""))):
        raise RequestValidationError("the sign-in's state does not match: start again")
    if not code:
        raise RequestValidationError("the provider sent no authorization code")
    tokens = provider.exchange(code, str(kept["v"]))
    id_token = tokens.get("id_token")
    if not isinstance(id_token, str):
        raise AuthenticationError("the OpenID provider sent no ID token")
    identity = provider.identity(provider.id_token_claims(id_token, str(kept["n"])))
    db: Database = request.app.state.db
    with db.session() as session:
        user = sync_user(session, provider, identity)
        principal = principal_of(session, user)
        value = create_session(session, settings, user.id, tokens.get("refresh_token"))
        record_sign_in(session, request, principal, identity.email or user.name)
        session.commit()
    response = RedirectResponse("/", status_code=303)
    response.delete_cookie(
        LOGIN_COOKIE, path="/auth/oidc", httponly=True, samesite="lax", secure=_secure(settings)
    )
    response.set_cookie(
        SESSION_COOKIE,
        value,
        path="/",
        httponly=True,
        samesite="lax",
        secure=_secure(settings),
    )
    response.headers["Cache-Control"] = "no-store"
    return response


def record_sign_in(session: Session, request: Request, principal: Principal, name: str) -> None:
    """The sign-in's event in the audit trail (docs/audit.md), in the session's transaction:
    the one place sign-ins are recorded."""
    audit.record(
        session,
        action="auth.oidc.sign_in",
        outcome=200,
        actor=principal,
        actor_name=name,
        via=audit.VIA_OIDC,
        source=request.client.host if request.client else None,
        target_kind="user",
        target_id=principal.user_id,
    )


@router.post("/auth/logout", status_code=204)
async def logout(request: Request) -> Response:
    """Sign out: the session cookie is cleared and its server-side session revoked (a token
    sign-in's cookie is only cleared: the token stays valid)."""
    value = request.cookies.get(SESSION_COOKIE, "").strip()
    if value and is_session_value(value):
        await run_in_threadpool(_revoke, request.app.state.db, value)
    response = Response(status_code=204)
    settings = _settings(request)
    for samesite in ("lax",):
        response.delete_cookie(
            SESSION_COOKIE, path="/", httponly=True, samesite=samesite, secure=_secure(settings)
        )
    return response


def _revoke(db: Database, value: str) -> None:
    with db.session() as session:
        if revoke_session(session, value):
            session.commit()
