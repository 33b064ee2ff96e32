"""Webhooks (docs/webhooks.md): users' subscriptions, and the outbox of their deliveries.

A subscription names a URL and events of its owner's jobs and sweeps, or, with a ``team``
(the team's id), of every job and sweep of that team, whoever submitted it. Its secret is
made here, shown once, and stored encrypted (Fernet): the deliveries are signed with it, so
it must be read back, unlike an API token's.

:func:`emit` writes one ``webhook_deliveries`` row per matching subscription in the caller's
transaction, the one that changes the job or sweep: the event is recorded if and only if the
change is, and an API that stops before sending loses nothing. The delivery loop
(:mod:`service.services.webhook_delivery`) sends them.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from cryptography.fernet import Fernet, InvalidToken
from sqlalchemy import delete, func, or_, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Team, Webhook, WebhookDelivery
from service.db.types import utcnow
from service.schemas.common import decode_cursor, encode_cursor
from service.services import refs
from service.services.ownership import sharing_teams
from service.services.tokens import DEFAULT_TEAM, Principal
from torchyard.contract.errors import (
    ConflictError,
    NotFoundError,
    PermissionDeniedError,
    RequestValidationError,
)
from torchyard.contract.webhooks import EVENTS, DeliveryPublic, WebhookCreated, WebhookPublic

# Most subscriptions one user may hold.
MAX_WEBHOOKS_PER_USER = 50
MAX_URL_LENGTH = 2000
KEY_FILE = "webhook.key"


# --- the secrets' key ---------------------------------------------------------------------------


def key_path(settings: Settings) -> Path:
    return settings.data_dir / KEY_FILE


def fernet(settings: Settings) -> Fernet:
    """What encrypts and decrypts the subscriptions' secrets: ``TORCHYARD_WEBHOOK_KEY``, or
    the data directory's ``webhook.key`` (made at first use, mode 0600)."""
    if settings.webhook_key is not None:
        return _fernet(settings.webhook_key.get_secret_value())
    return _fernet(_file_key(key_path(settings).resolve()))


@functools.lru_cache(maxsize=8)
def _fernet(key: str) -> Fernet:
    return Fernet(key.encode())


@functools.lru_cache(maxsize=8)
def _file_key(path: Path) -> str:
    """The key kept in ``path``, written there first if there is none. Several API processes
    starting at once agree: the file is linked into place only if absent, and whoever finds it
    there reads it."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, Fernet.generate_key() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return path.read_text().strip()


def secret_of(settings: Settings, webhook: Webhook) -> str:
    """The subscription's signing secret, decrypted."""
    try:
        return fernet(settings).decrypt(webhook.secret_encrypted.encode()).decode()
    except InvalidToken:
        raise ConflictError(
            f"the secret of webhook {webhook.id} cannot be decrypted: it was encrypted under another "
            "key than TORCHYARD_WEBHOOK_KEY (or the data directory's webhook.key) now holds"
        ) from None


# --- subscriptions ------------------------------------------------------------------------------


def check_url(url: str) -> str:
    """``url`` if it is an http(s) URL with a host, within :data:`MAX_URL_LENGTH`; else 422."""
    url = url.strip()
    if len(url) > MAX_URL_LENGTH:
        raise RequestValidationError(
            f"url is longer than {MAX_URL_LENGTH} characters", details={"field": "url"}
        )
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        raise RequestValidationError(f"url is not a valid URL: {exc}", details={"field": "url"}) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RequestValidationError(
            f"url must be an http:// or https:// URL with a host, not {url[:200]!r}", details={"field": "url"}
        )
    if any(ch.isspace() or ord(ch) < 32 for ch in url):
        raise RequestValidationError(
            "url must not contain spaces or control characters", details={"field": "url"}
        )
    return url


def check_events(events: list[str]) -> list[str]:
    """The events, each once, in the order given; a 422 naming the known ones otherwise."""
    allowed = ", ".join(EVENTS)
    if not events:
        raise RequestValidationError(
            f"events must name at least one of: {allowed}", details={"field": "events"}
        )
    unknown = [e for e in events if e not in EVENTS]
    if unknown:
        raise RequestValidationError(
            f"unknown event {unknown[0][:100]!r}: events are {allowed}", details={"field": "events"}
        )
    return list(dict.fromkeys(events))


def subscribed_team(session: Session, principal: Principal, name: str) -> Team:
    """The team a new subscription is for: one of the principal's (any for an admin), never
    ``default``, which every user is in and which shares nothing; else 422 (404 for an admin
    naming no team)."""
    if name == DEFAULT_TEAM:
        raise RequestValidationError(
            f"the team {DEFAULT_TEAM!r} shares nothing (every user is in it): subscribe without a team "
            "for the events of your own jobs, or name another of your teams",
            details={"field": "team"},
        )
    if name in principal.team_names or principal.is_admin:
        team = session.scalars(select(Team).where(Team.name == name)).first()
        if team is not None:
            return team
        if principal.is_admin:
            raise NotFoundError(f"team {name[:100]!r} not found")
    yours = [t for t in principal.team_names if t != DEFAULT_TEAM]
    raise RequestValidationError(
        f"you are not in team {name[:100]!r}: your teams are {', '.join(yours) or 'none but default'}",
        details={"field": "team", "teams": yours},
    )


def create_webhook(
    session: Session,
    settings: Settings,
    principal: Principal,
    url: str,
    events: list[str],
    team: str | None = None,
) -> WebhookCreated:
    """A new subscription of ``principal``'s (of ``team``'s jobs and sweeps when it names one),
    with its secret (returned this once)."""
    url, events = check_url(url), check_events(events)
    team_row = subscribed_team(session, principal, team) if team is not None else None
    held = session.scalar(select(func.count()).select_from(Webhook).where(Webhook.owner_id == principal.id))
    if (held or 0) >= MAX_WEBHOOKS_PER_USER:
        raise ConflictError(
            f"you already have {MAX_WEBHOOKS_PER_USER} webhooks, the most one user may have: delete one first"
        )
    secret = secrets.token_urlsafe(32)
    row = Webhook(
        owner_id=principal.id,
        team=team_row.id if team_row is not None else None,
        url=url,
        events=events,
        secret_encrypted=fernet(settings).encrypt(secret.encode()).decode(),
        created_at=utcnow(),
    )
    session.add(row)
    session.commit()
    return WebhookCreated(**webhook_public(session, row).model_dump(), secret=secret)


def team_names(session: Session, rows: list[Webhook]) -> dict[str, str]:
    """The names of the teams the subscriptions ``rows`` are for, by id."""
    ids = {row.team for row in rows if row.team is not None}
    if not ids:
        return {}
    return {
        team_id: name for team_id, name in session.execute(select(Team.id, Team.name).where(Team.id.in_(ids)))
    }


def webhook_public(session: Session, row: Webhook, names: dict[str, str] | None = None) -> WebhookPublic:
    """The subscription as the API shows it: its team by name (null for a user's own)."""
    if names is None:
        names = team_names(session, [row])
    return WebhookPublic(
        id=row.id,
        url=row.url,
        events=list(row.events),
        owner=row.owner_id,
        team=names.get(row.team) if row.team is not None else None,
        created_at=row.created_at,
    )


def webhooks_public(session: Session, rows: list[Webhook]) -> list[WebhookPublic]:
    names = team_names(session, rows)
    return [webhook_public(session, row, names) for row in rows]


def list_webhooks(session: Session, principal: Principal) -> list[Webhook]:
    """The caller's subscriptions and those of their teams (``default`` aside), oldest first."""
    seen = or_(Webhook.owner_id == principal.id, Webhook.team.in_(sharing_teams(principal)))
    stmt = select(Webhook).where(seen).order_by(Webhook.created_at, Webhook.id)
    return list(session.scalars(stmt))


def get_webhook(session: Session, principal: Principal, webhook_id: str) -> Webhook:
    """The subscription ``webhook_id``: the caller's own, one of their teams', any team's for an
    admin; another's is not found (404), as one that does not exist."""
    row = session.get(Webhook, webhook_id) if refs.comparable(webhook_id) else None
    if row is None or not (
        row.owner_id == principal.id
        or (row.team is not None and (principal.is_admin or row.team in sharing_teams(principal)))
    ):
        raise NotFoundError(f"webhook {webhook_id[:100]!r} not found (none of yours has this id)")
    return row


def delete_webhook(session: Session, principal: Principal, webhook_id: str) -> WebhookPublic:
    """Unsubscribe: the subscription and its deliveries (pending ones are not sent) go. A team's
    subscription is deleted by whoever made it or an admin (403 for the team's others)."""
    row = get_webhook(session, principal, webhook_id)
    if row.owner_id != principal.id and not principal.is_admin:
        raise PermissionDeniedError(
            f"webhook {row.id} is team {webhook_public(session, row).team!r}'s, made by another user: "
            "only they or an admin may delete it"
        )
    shown = webhook_public(session, row)
    session.execute(delete(WebhookDelivery).where(WebhookDelivery.webhook_id == row.id))
    session.delete(row)
    session.commit()
    return shown


def list_deliveries(
    session: Session, principal: Principal, webhook_id: str, *, limit: int, cursor: str | None
) -> tuple[list[DeliveryPublic], str | None]:
    """The subscription's deliveries, newest first."""
    row = get_webhook(session, principal, webhook_id)
    stmt = select(WebhookDelivery).where(WebhookDelivery.webhook_id == row.id)
    if cursor:
        created_iso, last_id = decode_cursor(cursor, 2)
        try:
            created = datetime.fromisoformat(created_iso)
        except (TypeError, ValueError) as exc:
            raise RequestValidationError("cursor is not one this service issued") from exc
        stmt = stmt.where(
            (WebhookDelivery.created_at < created)
            | ((WebhookDelivery.created_at == created) & (WebhookDelivery.id < last_id))
        )
    order = (WebhookDelivery.created_at.desc(), WebhookDelivery.id.desc())
    rows = list(session.scalars(stmt.order_by(*order).limit(limit + 1)))
    next_cursor = None
    if len(rows) > limit:
        rows = rows[:limit]
        next_cursor = encode_cursor(rows[-1].created_at.isoformat(), rows[-1].id)
    return [delivery_public(d) for d in rows], next_cursor


def delivery_public(row: WebhookDelivery) -> DeliveryPublic:
    return DeliveryPublic(
        id=row.id,
        webhook_id=row.webhook_id,
        event=row.event,
        status=row.status,  # type: ignore[arg-type]  # the status check constraint
        attempts=row.attempts,
        last_status=row.last_status,
        last_response=row.last_response,
        next_attempt_at=row.next_attempt_at if row.status == "pending" else None,
        created_at=row.created_at,
        last_attempt_at=row.last_attempt_at,
        finished_at=row.finished_at,
    )


# --- the outbox ---------------------------------------------------------------------------------


def emit(
    session: Session,
    owner_id: str,
    event: str,
    subject: str,
    shown: Callable[[], dict[str, Any]],
    *,
    team_id: str | None = None,
) -> int:
    """Record ``event`` of ``owner_id``'s job or sweep (``subject``: ``"job"`` or ``"sweep"``)
    of team ``team_id`` for each subscription that asked for it, in the caller's transaction:
    the owner's own, and the team's (whoever made them). A subscription that is both (the
    owner's own for their team) gets one delivery. ``shown`` makes the job or sweep as its
    owner sees it (called only when someone listens). Returns how many deliveries were
    recorded."""
    assert event in EVENTS, event
    listening = Webhook.owner_id == owner_id
    if team_id is not None:
        # Own subscriptions of the owner's, and the team's: one row each, however many match.
        listening = or_(listening, Webhook.team == team_id)
    hooks = [
        hook for hook in session.scalars(select(Webhook).where(listening)) if event in (hook.events or [])
    ]
    if not hooks:
        return 0
    now = utcnow()
    body = json.dumps(
        {"event": event, subject: shown(), "at": now.isoformat()}, separators=(",", ":"), sort_keys=True
    )
    for hook in hooks:
        session.add(
            WebhookDelivery(
                webhook_id=hook.id,
                event=event,
                body=body,
                status="pending",
                attempts=0,
                next_attempt_at=now,
                created_at=now,
            )
        )
    return len(hooks)
