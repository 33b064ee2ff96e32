"""The audit trail (docs/audit.md): every change made through the API, appended with who,
when, from where and what, and the status the API answered.

Rows are only ever added: this module has no function that updates or deletes one, and no
route does (retention is the operators' business: they archive the export). The API's
middleware (``service/api/audit_trail.py``) records each user or admin write after its
answer's status is known; a sign-in that is not a request of its own (OpenID Connect's
callback) calls :func:`record` itself.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from service.db.engine import Database
from service.db.models import AuditEvent, User
from service.db.types import utcnow
from service.schemas.common import decode_cursor, encode_cursor
from service.services.tokens import Principal
from torchyard.contract.audit import AuditActor, AuditEventPublic, AuditTarget
from torchyard.contract.errors import RequestValidationError

log = logging.getLogger(__name__)

# How a request was signed in (the ``via`` column).
VIA_TOKEN = "token"
VIA_SESSION = "session"
VIA_OIDC = "oidc"
VIA_NONE = "none"

# Fields whose values are never written, whatever the caller passes: a request's secrets.
_SECRET_WORDS = ("token", "secret", "password", "passwd", "credential", "authorization", "key")
REDACTED = "[redacted]"
# Details stay small: strings, lists and the whole are cut to these.
_MAX_STRING = 200
_MAX_ITEMS = 20
_MAX_DEPTH = 3
_MAX_DETAILS_CHARS = 2000
_MAX_SOURCE = 100
_MAX_TARGET = 300
# Rows read per query by the export.
EXPORT_BATCH = 500


def is_secret_field(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in _SECRET_WORDS)


def clean_details(value: Any, depth: int = 0) -> Any:
    """``value`` made safe and small for the trail: secret-named fields redacted, long
    strings and lists cut, nesting below :data:`_MAX_DEPTH` summarised."""
    if isinstance(value, dict):
        if depth >= _MAX_DEPTH:
            return f"{{{len(value)} fields}}"
        return {
            str(k)[:_MAX_STRING]: REDACTED if is_secret_field(str(k)) else clean_details(v, depth + 1)
            for k, v in list(value.items())[:_MAX_ITEMS]
        }
    if isinstance(value, list | tuple):
        if depth >= _MAX_DEPTH:
            return f"[{len(value)} items]"
        return [clean_details(v, depth + 1) for v in list(value)[:_MAX_ITEMS]]
    if isinstance(value, str):
        return value if len(value) <= _MAX_STRING else value[: _MAX_STRING - 1] + "…"
    if value is None or isinstance(value, bool | int | float):
        return value
    return clean_details(str(value), depth)


def _bounded(details: dict[str, Any]) -> dict[str, Any]:
    cleaned = clean_details(details)
    if len(json.dumps(cleaned, default=str)) > _MAX_DETAILS_CHARS:
        return {"fields": sorted(cleaned)[:_MAX_ITEMS], "truncated": True}
    return dict(cleaned)


def _actor_name(session: Session, actor: Principal | None) -> str | None:
    if actor is None:
        return None
    if actor.user_id is not None:
        name = session.scalar(select(User.name).where(User.id == actor.user_id))
        if name is not None:
            return name
    return actor.name


def _row(
    session: Session,
    *,
    action: str,
    outcome: int,
    actor: Principal | None,
    actor_name: str | None,
    via: str,
    source: str | None,
    target_kind: str | None,
    target_id: str | None,
    details: dict[str, Any] | None,
) -> AuditEvent:
    return AuditEvent(
        at=utcnow(),
        actor_name=(actor_name or _actor_name(session, actor) or None),
        actor_token_id=actor.id if actor is not None else None,
        actor_token_name=actor.name[:200] if actor is not None else None,
        actor_role=str(actor.role) if actor is not None else None,
        via=via[:16],
        source=source[:_MAX_SOURCE] if source else None,
        action=action[:64],
        target_kind=target_kind[:32] if target_kind else None,
        target_id=target_id[:_MAX_TARGET] if target_id else None,
        outcome=int(outcome),
        details=_bounded(details or {}),
    )


def record(
    session_or_db: Session | Database,
    *,
    action: str,
    outcome: int,
    actor: Principal | None = None,
    actor_name: str | None = None,
    via: str = VIA_TOKEN,
    source: str | None = None,
    target_kind: str | None = None,
    target_id: str | None = None,
    details: dict[str, Any] | None = None,
) -> None:
    """Append one event to the trail.

    Given a :class:`Session`, the row joins that session's transaction (the caller commits:
    the event is written with the change it tells of, or not at all). Given the
    :class:`Database`, the row is written in a short transaction of its own; a failure to
    write it is logged, never raised (the change it tells of has happened already).

    ``actor`` is who made the change (None when nobody could be told: a refused token);
    ``actor_name`` overrides the name read from the actor's user (a sign-in through the
    identity provider names the person). ``details`` is cleaned (:func:`clean_details`):
    fields named like secrets are redacted and everything is cut small.
    """
    fields: dict[str, Any] = {
        "action": action,
        "outcome": outcome,
        "actor": actor,
        "actor_name": actor_name,
        "via": via,
        "source": source,
        "target_kind": target_kind,
        "target_id": target_id,
        "details": details,
    }
    if isinstance(session_or_db, Session):
        session_or_db.add(_row(session_or_db, **fields))
        session_or_db.flush()
        return
    try:
        with session_or_db.transaction() as session:
            session.add(_row(session, **fields))
    except SQLAlchemyError as exc:
        log.error("could not write the audit event %s (status %s): %s", action, outcome, exc)


def _parse_cursor(cursor: str) -> int:
    (last_id,) = decode_cursor(cursor, 1)
    if not isinstance(last_id, int) or isinstance(last_id, bool):
        raise RequestValidationError("cursor is not one this service issued")
    return last_id


def _filtered(
    stmt: Any,
    *,
    actor: str | None,
    action: str | None,
    target: str | None,
    since: datetime | None,
    until: datetime | None,
) -> Any:
    if actor:
        stmt = stmt.where(
            or_(
                AuditEvent.actor_name == actor,
                AuditEvent.actor_token_name == actor,
                AuditEvent.actor_token_id == actor,
            )
        )
    if action:
        # ``job.`` is every job action, ``job.submit`` that one (or any action it starts).
        stmt = stmt.where(AuditEvent.action.startswith(action, autoescape=True))
    if target:
        kind, sep, ident = target.partition(":")
        if sep and kind and ident:
            stmt = stmt.where(
                or_(
                    AuditEvent.target_id == target,
                    (AuditEvent.target_kind == kind) & (AuditEvent.target_id == ident),
                )
            )
        else:
            stmt = stmt.where(AuditEvent.target_id == target)
    if since is not None:
        stmt = stmt.where(AuditEvent.at >= since)
    if until is not None:
        stmt = stmt.where(AuditEvent.at < until)
    return stmt


def list_events(
    session: Session,
    *,
    actor: str | None = None,
    action: str | None = None,
    target: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 50,
    cursor: str | None = None,
) -> tuple[list[AuditEventPublic], str | None]:
    """The events that match, newest first, ``limit`` a page, and the next page's cursor."""
    stmt = _filtered(select(AuditEvent), actor=actor, action=action, target=target, since=since, until=until)
    if cursor:
        stmt = stmt.where(AuditEvent.id < _parse_cursor(cursor))
    rows = list(session.scalars(stmt.order_by(AuditEvent.id.desc()).limit(limit + 1)))
    next_cursor = None
    if len(rows) > limit:
        rows = rows[:limit]
        next_cursor = encode_cursor(rows[-1].id)
    return [event_public(row) for row in rows], next_cursor


def export_events(
    db: Database,
    *,
    actor: str | None = None,
    action: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    batch: int = EXPORT_BATCH,
) -> Iterator[list[AuditEventPublic]]:
    """The events that match, oldest first, in batches each read in a short transaction of
    its own (an export of millions of events holds no transaction open while it is sent)."""
    last_id = 0
    while True:
        with db.read_session() as session:
            stmt = _filtered(
                select(AuditEvent), actor=actor, action=action, target=None, since=since, until=until
            )
            rows = list(
                session.scalars(stmt.where(AuditEvent.id > last_id).order_by(AuditEvent.id).limit(batch))
            )
            events = [event_public(row) for row in rows]
        if not events:
            return
        yield events
        if len(events) < batch:
            return
        last_id = events[-1].id


def event_public(row: AuditEvent) -> AuditEventPublic:
    return AuditEventPublic(
        id=row.id,
        at=row.at,
        actor=AuditActor(
            name=row.actor_name,
            token_id=row.actor_token_id,
            token_name=row.actor_token_name,
            role=row.actor_role,
        ),
        via=row.via,
        source=row.source,
        action=row.action,
        target=AuditTarget(kind=row.target_kind, id=row.target_id),
        outcome=row.outcome,
        details=row.details or {},
    )
