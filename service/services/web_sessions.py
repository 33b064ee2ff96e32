"""The web UI's sign-ins through the OpenID provider, kept server-side (docs/oidc.md).

The cookie holds a random value; the table ``sessions`` keeps only its hash, the user, the
expiry and the provider's refresh token (encrypted with the webhook secrets' Fernet key).
Every request reads the row and the user: a session revoked (sign-out) or of a disabled user
stops at once, on every replica. A session past its expiry is renewed with the refresh token
(the provider may refuse: the user was removed there), its groups brought up to date from the
fresh access token.
"""

from __future__ import annotations

import hmac
import secrets
from datetime import timedelta

from cryptography.fernet import InvalidToken
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import User, WebSession
from service.db.types import utcnow
from service.services.oidc import OidcProvider, principal_of, session_hash, sync_user
from service.services.tokens import Principal
from service.services.webhooks import fernet
from torchyard.contract.errors import AuthenticationError

SESSION_PREFIX = "tys_"
# ``last_seen_at`` is written at most this often per session.
SEEN_RESOLUTION = timedelta(minutes=1)


def is_session_value(value: str) -> bool:
    return value.startswith(SESSION_PREFIX)


def create_session(session: Session, settings: Settings, user_id: str, refresh_token: str | None) -> str:
    """A new session of ``user_id``; returns the cookie's value (never stored). The caller commits."""
    plain = SESSION_PREFIX + secrets.token_urlsafe(32)
    now = utcnow()
    session.add(
        WebSession(
            id_hash=session_hash(plain),
            user_id=user_id,
            created_at=now,
            last_seen_at=now,
            expires_at=now + timedelta(seconds=settings.session_ttl_s),
            refresh_token=_seal(settings, refresh_token),
        )
    )
    session.flush()
    return plain


def _seal(settings: Settings, refresh_token: str | None) -> str | None:
    if not refresh_token:
        return None
    return fernet(settings).encrypt(refresh_token.encode()).decode()


def _unseal(settings: Settings, sealed: str | None) -> str | None:
    if not sealed:
        return None
    try:
        return fernet(settings).decrypt(sealed.encode()).decode()
    except InvalidToken:
        return None  # the key changed: the session cannot be renewed


def _find(session: Session, value: str) -> WebSession | None:
    digest = session_hash(value)
    row = session.scalars(select(WebSession).where(WebSession.id_hash == digest)).first()
    if row is None or not hmac.compare_digest(row.id_hash, digest):
        return None
    return row


def authenticate_session(
    session: Session, settings: Settings, provider: OidcProvider | None, value: str
) -> Principal:
    """The principal of a session cookie, read in ``session`` (a writing one: a due renewal or
    ``last_seen_at`` is written and committed here)."""
    row = _find(session, value)
    if row is None or row.revoked_at is not None:
        raise AuthenticationError("signed out: sign in again")
    user = session.get(User, row.user_id)
    if user is None or user.disabled_at is not None:
        raise AuthenticationError("this user is disabled")
    now = utcnow()
    if row.expires_at <= now:
        refresh_token = _unseal(settings, row.refresh_token)
        if provider is None or refresh_token is None:
            row.revoked_at = now
            session.commit()
            raise AuthenticationError("the sign-in expired: sign in again")
        try:
            tokens = provider.refresh(refresh_token)
            access = tokens.get("access_token")
            if isinstance(access, str) and access:
                user = sync_user(session, provider, provider.identity(provider.access_token_claims(access)))
        except AuthenticationError:
            row.revoked_at = now
            session.commit()
            raise AuthenticationError("the sign-in expired and the provider refused to renew it") from None
        row.expires_at = now + timedelta(seconds=settings.session_ttl_s)
        if tokens.get("refresh_token"):
            row.refresh_token = _seal(settings, str(tokens["refresh_token"]))
        row.last_seen_at = now
        session.commit()
    elif now - row.last_seen_at >= SEEN_RESOLUTION:
        row.last_seen_at = now
        session.commit()
    return principal_of(session, user, session_id=row.id)


def revoke_session(session: Session, value: str) -> bool:
    """End the session of a cookie (sign-out); the caller commits. False if there was none."""
    row = _find(session, value)
    if row is None or row.revoked_at is not None:
        return False
    row.revoked_at = utcnow()
    row.refresh_token = None
    return True


def revoke_user_sessions(session: Session, user_id: str) -> None:
    """End every session of a user (they were disabled); the caller commits."""
    session.execute(
        update(WebSession)
        .where(WebSession.user_id == user_id, WebSession.revoked_at.is_(None))
        .values(revoked_at=utcnow(), refresh_token=None)
        .execution_options(synchronize_session=False)
    )


def session_live(session: Session, session_id: str) -> bool:
    """Whether a session is still signed in (for open streams): not revoked, its user enabled."""
    row = session.get(WebSession, session_id)
    if row is None or row.revoked_at is not None:
        return False
    disabled = session.scalar(select(User.disabled_at).where(User.id == row.user_id))
    return disabled is None
