"""Webhooks (docs/webhooks.md): users' subscriptions, and the outbox of their deliveries.

A subscription names a URL and events of its owner's jobs and sweeps. Its secret is made
here, shown once, and stored encrypted (Fernet): the deliveries are signed with it, so it
must be read back, unlike an API token's. Subscriptions are a user's today; ``team`` is
kept for a team's subscriptions, which come with teams.

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
from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Webhook, WebhookDelivery
from service.db.types import utcnow
from service.schemas.common import decode_cursor, encode_cursor
from service.services import refs
from service.services.tokens import Principal
from torchyard.contract.errors import ConflictError, NotFoundError, RequestValidationError
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


def create_webhook(
    session: Session, settings: Settings, principal: Principal, url: str, events: list[str]
) -> WebhookCreated:
    """A new subscription of ``principal``'s, with its secret (returned this once)."""
    url, events = check_url(url), check_events(events)
    held = session.scalar(select(func.count()).select_from(Webhook).where(Webhook.owner_id == principal.id))
    if (held or 0) >= MAX_WEBHOOKS_PER_USER:
        raise ConflictError(
            f"you already have {MAX_WEBHOOKS_PER_USER} webhooks, the most one user may have: delete one first"
        )
    secret = secrets.token_urlsafe(32)
    row = Webhook(
        owner_id=principal.id,
        url=url,
        events=events,
        secret_encrypted=fernet(settings).encrypt(secret.encode()).decode(),
        created_at=utcnow(),
    )
    session.add(row)
    session.commit()
    return WebhookCreated(**webhook_public(row).model_dump(), secret=secret)


def webhook_public(row: Webhook) -> WebhookPublic:
    return WebhookPublic(
        id=row.id,
        url=row.url,
        events=list(row.events),
        owner=row.owner_id,
        team=row.team,
        created_at=row.created_at,
    )


def list_webhooks(session: Session, principal: Principal) -> list[Webhook]:
    """The caller's subscriptions, oldest first."""
    stmt = select(Webhook).where(Webhook.owner_id == principal.id).order_by(Webhook.created_at, Webhook.id)
    return list(session.scalars(stmt))


def get_webhook(session: Session, principal: Principal, webhook_id: str) -> Webhook:
    """The caller's subscription ``webhook_id``; another user's is not found (404), as one
    that does not exist."""
    row = session.get(Webhook, webhook_id) if refs.comparable(webhook_id) else None
    if row is None or row.owner_id != principal.id:
        raise NotFoundError(f"webhook {webhook_id[:100]!r} not found (none of yours has this id)")
    return row


def delete_webhook(session: Session, principal: Principal, webhook_id: str) -> WebhookPublic:
    """Unsubscribe: the subscription and its deliveries (pending ones are not sent) go."""
    row = get_webhook(session, principal, webhook_id)
    shown = webhook_public(row)
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
    session: Session, owner_id: str, event: str, subject: str, shown: Callable[[], dict[str, Any]]
) -> int:
    """Record ``event`` of ``owner_id``'s job or sweep (``subject``: ``"job"`` or ``"sweep"``)
    for each subscription of the owner's that asked for it, in the caller's transaction.
    ``shown`` makes the job or sweep as its owner sees it (called only when someone listens).
    Returns how many deliveries were recorded."""
    assert event in EVENTS, event
    hooks = [
        hook
        for hook in session.scalars(select(Webhook).where(Webhook.owner_id == owner_id))
        if event in (hook.events or [])
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
