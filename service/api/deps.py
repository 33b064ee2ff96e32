"""Request dependencies, declared once: sessions, settings and who is asking."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.engine import Database
from service.services.tokens import Principal, authenticate
from service.services.wakeup import Wakeup
from service.states import Role
from torchyard.errors import PermissionDeniedError


def get_db(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


def get_settings_dep(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    """A writing session; services commit what they change."""
    with get_db(request).session() as session:
        yield session


def get_read_session(request: Request) -> Iterator[Session]:
    with get_db(request).read_session() as session:
        yield session


def get_wakeup(request: Request) -> Wakeup:
    """The replica's wake-up for long-polling claims (notify after queuing work)."""
    wakeup: Wakeup = request.app.state.wakeup
    return wakeup


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


def get_principal(request: Request) -> Principal:
    cached: Principal | None = getattr(request.state, "principal", None)
    if cached is not None:
        return cached
    with get_db(request).read_session() as session:
        principal = authenticate(session, _bearer(request))
    request.state.principal = principal
    return principal


def require_user(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    if principal.role not in (Role.USER, Role.ADMIN):
        raise PermissionDeniedError("worker tokens reach only worker routes")
    return principal


def require_admin(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    if principal.role is not Role.ADMIN:
        raise PermissionDeniedError("this route needs an admin token")
    return principal


def require_worker(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    if principal.role is not Role.WORKER:
        raise PermissionDeniedError("this route needs a worker token")
    return principal


DatabaseDep = Annotated[Database, Depends(get_db)]
SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
SessionDep = Annotated[Session, Depends(get_session)]
ReadSessionDep = Annotated[Session, Depends(get_read_session)]
CurrentUser = Annotated[Principal, Depends(require_user)]
AdminUser = Annotated[Principal, Depends(require_admin)]
WorkerDep = Annotated[Principal, Depends(require_worker)]
WakeupDep = Annotated[Wakeup, Depends(get_wakeup)]
