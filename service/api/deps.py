"""Request dependencies, declared once: sessions, settings and who is asking.

Every dependency is ``async``: FastAPI runs a sync one in the thread pool, a round trip
through another thread (and a wait for the GIL) per dependency and per request. Only the
database work (reading the token, closing a session still holding a connection) goes to
the thread pool, once.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Annotated

from fastapi import Depends, Header, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.api.security import CSRF_HEADER, SAFE_METHODS, SESSION_COOKIE
from service.config import Settings
from service.db.engine import Database
from service.db.types import utcnow
from service.services.node_timing import NodeTiming
from service.services.oidc import OidcProvider, looks_like_jwt
from service.services.oidc import authenticate_access_token as principal_for_access_token
from service.services.scheduler_loop import SchedulerLoop
from service.services.tokens import USE_RECORDER, Principal, authenticate, record_use
from service.services.wakeup import Wakeup
from service.services.web_sessions import authenticate_session, is_session_value
from service.states import Role
from torchyard.contract.errors import PermissionDeniedError
from torchyard.contract.headers import AGENT_KEY_HEADER, LEASE_HEADER

log = logging.getLogger(__name__)


async def get_db(request: Request) -> Database:
    return _db(request)


async def get_settings_dep(request: Request) -> Settings:
    """The replica's settings, with the heartbeat interval and lease timeout of the moment
    (:mod:`service.services.node_timing`)."""
    timing: NodeTiming = request.app.state.timing
    return timing.settings()


def _db(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


async def _close(session: Session) -> None:
    """Close ``session``: in a worker thread if it still holds a connection (giving it back
    rolls back, a round trip), here when a sync endpoint already closed it."""
    if session.in_transaction():
        await run_in_threadpool(session.close)
    else:
        session.close()


async def get_session(request: Request) -> AsyncIterator[Session]:
    """A writing session; services commit what they change. Creating it connects nothing."""
    session = _db(request).session()
    try:
        yield session
    finally:
        await _close(session)


async def get_read_session(request: Request) -> AsyncIterator[Session]:
    session = _db(request).read_session()
    try:
        yield session
    finally:
        await _close(session)


async def get_wakeup(request: Request) -> Wakeup:
    """The replica's wake-up for long-polling claims (notified for the nodes a pass placed on)."""
    wakeup: Wakeup = request.app.state.wakeup
    return wakeup


async def get_scheduling(request: Request) -> SchedulerLoop:
    """The replica's scheduling loop: ask it for a pass after committing a change that may
    let a queued job start."""
    scheduling: SchedulerLoop = request.app.state.scheduling
    return scheduling


# A security scheme rather than a plain header, so that the OpenAPI schema marks every
# route that needs a token (and the docs' Authorize button sends it). A missing or
# malformed header is left to authenticate(), which answers 401 AuthenticationError.
_BEARER = HTTPBearer(
    scheme_name="bearerAuth",
    auto_error=False,
    description="An API token: the admin token written to admin.token in the data directory at "
    "first start, or one created with POST /v1/tokens; or, where OpenID Connect is set up "
    "(docs/oidc.md), an access token of the provider.",
)
BearerCredentials = Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)]


def _token(credentials: HTTPAuthorizationCredentials | None) -> str | None:
    return (credentials.credentials.strip() or None) if credentials is not None else None


def _cookie_token(request: Request) -> str | None:
    """The web UI's sign-in cookie (see ``service/api/security.py``), for a request without
    an Authorization header. A write authenticated this way must carry the CSRF header."""
    token = request.cookies.get(SESSION_COOKIE, "").strip() or None
    if token is not None and request.method not in SAFE_METHODS and not request.headers.get(CSRF_HEADER):
        raise PermissionDeniedError(f"a write signed in by cookie must carry the {CSRF_HEADER} header")
    return token


async def get_principal(request: Request, credentials: BearerCredentials) -> Principal:
    cached: Principal | None = getattr(request.state, "principal", None)
    if cached is not None:
        return cached
    token = _token(credentials) if credentials is not None else _cookie_token(request)
    provider: OidcProvider | None = getattr(request.app.state, "oidc", None)
    if token is not None and is_session_value(token):
        settings: Settings = request.app.state.settings
        principal = await run_in_threadpool(_session_principal, _db(request), settings, provider, token)
    elif token is not None and provider is not None and looks_like_jwt(token):
        principal = await run_in_threadpool(_access_token_principal, _db(request), provider, token)
    else:
        principal = await run_in_threadpool(_authenticate, _db(request), token)
    request.state.principal = principal
    return principal


def _session_principal(
    db: Database, settings: Settings, provider: OidcProvider | None, value: str
) -> Principal:
    """Who a web session cookie belongs to (docs/oidc.md), read on every request."""
    with db.session() as session:
        return authenticate_session(session, settings, provider, value)


def _access_token_principal(db: Database, provider: OidcProvider, token: str) -> Principal:
    """Who a provider's access token is for; their teams follow its groups (docs/oidc.md)."""
    with db.session() as session:
        principal = principal_for_access_token(session, provider, token)
        session.commit()
    return principal


def _authenticate(db: Database, token: str | None) -> Principal:
    """Who ``token`` belongs to, read from the database (a worker thread)."""
    with db.read_session() as session:
        principal = authenticate(session, token)
    now = utcnow()
    if USE_RECORDER.should_record(principal, now):
        _record_use(db, principal, now)
    return principal


def _record_use(db: Database, principal: Principal, now: datetime) -> None:
    """Refresh the token's last-used time (at most once a minute); never fails the request."""
    try:
        with db.session() as session:
            record_use(session, principal.id, now)
            session.commit()
    except SQLAlchemyError as exc:
        USE_RECORDER.failed(principal.id)
        log.warning("could not record the use of token %s: %s", principal.id, exc)


async def require_user(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    if principal.role not in (Role.USER, Role.ADMIN):
        raise PermissionDeniedError("worker tokens reach only worker routes")
    return principal


async def require_admin(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    if principal.role is not Role.ADMIN:
        raise PermissionDeniedError("this route needs an admin token")
    return principal


def check_worker(principal: Principal) -> Principal:
    if principal.role is not Role.WORKER:
        raise PermissionDeniedError("this route needs a worker token")
    return principal


def check_agent(principal: Principal) -> Principal:
    """A worker token of a resident agent: a launch token (one attempt's) may not speak for a node."""
    check_worker(principal)
    if principal.attempt_id is not None:
        raise PermissionDeniedError("a launch token reaches only its own attempt's placements")
    return principal


async def require_worker(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    return check_worker(principal)


async def require_agent(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    return check_agent(principal)


async def get_token(request: Request, credentials: BearerCredentials) -> str | None:
    """The bearer token as sent, not checked yet: for a hot route that checks it in the same
    worker-thread trip as its own work (:func:`agent_session`)."""
    return _token(credentials) if credentials is not None else _cookie_token(request)


@contextmanager
def agent_session(db: Database, token: str | None) -> Iterator[tuple[Session, Principal]]:
    """A write session whose first statement checks ``token`` (a resident agent's, as
    :data:`AgentDep` does): the hottest worker routes check the token and do their work in one
    transaction on one connection, instead of a connection and transaction each. A due
    write of the token's last use joins that transaction: committed with the work, or left
    to a later request when the work fails."""
    with db.session() as session:
        principal, recording = agent_in(session, token)
        try:
            yield session, principal
        except BaseException:
            if recording:
                USE_RECORDER.failed(principal.id)
            raise


def agent_in(session: Session, token: str | None) -> tuple[Principal, bool]:
    """The resident agent behind ``token``, read in ``session``, with a due write of the
    token's last use added to it; and whether that write was added (if the transaction
    fails, :meth:`UseRecorder.failed` must be called for the token)."""
    principal = check_agent(authenticate(session, token))
    now = utcnow()
    recording = USE_RECORDER.should_record(principal, now)
    if recording:
        record_use(session, principal.id, now)
    return principal, recording


async def require_launcher(principal: Annotated[Principal, Depends(require_worker)]) -> Principal:
    """A launch token (docs/slurm.md): the one-placement launcher of one attempt."""
    if principal.attempt_id is None:
        raise PermissionDeniedError("this route needs the launch token of an attempt")
    return principal


async def get_agent_key(
    key: Annotated[
        str | None,
        Header(alias=AGENT_KEY_HEADER, description="The agent's per-node key, as sent at registration."),
    ] = None,
) -> str | None:
    return key


DatabaseDep = Annotated[Database, Depends(get_db)]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
SessionDep = Annotated[Session, Depends(get_session)]
ReadSessionDep = Annotated[Session, Depends(get_read_session)]
CurrentUser = Annotated[Principal, Depends(require_user)]
AdminUser = Annotated[Principal, Depends(require_admin)]
WorkerDep = Annotated[Principal, Depends(require_worker)]
AgentDep = Annotated[Principal, Depends(require_agent)]
LauncherDep = Annotated[Principal, Depends(require_launcher)]
WakeupDep = Annotated[Wakeup, Depends(get_wakeup)]
SchedulingDep = Annotated[SchedulerLoop, Depends(get_scheduling)]
AgentKeyDep = Annotated[str | None, Depends(get_agent_key)]
TokenDep = Annotated[str | None, Depends(get_token)]
LeaseHeader = Annotated[str | None, Header(alias=LEASE_HEADER, description="The placement's lease token.")]
