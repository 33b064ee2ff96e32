"""API tokens: created once, stored only as a hash, compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import Token
from service.states import Role
from torchyard.errors import AuthenticationError

log = logging.getLogger(__name__)

TOKEN_PREFIX = "ty_"


@dataclass(frozen=True)
class Principal:
    """Who is asking: a token's id, name and role."""

    id: str
    name: str
    role: Role

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(session: Session, name: str, role: Role) -> tuple[Token, str]:
    """Create a token; the plain value is returned once and never stored."""
    plain = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = Token(name=name, role=role.value, token_hash=hash_token(plain))
    session.add(row)
    session.flush()
    return row, plain


def authenticate(session: Session, token: str | None) -> Principal:
    if not token:
        raise AuthenticationError("missing bearer token (Authorization: Bearer <token>)")
    digest = hash_token(token)
    row = session.scalars(select(Token).where(Token.token_hash == digest)).first()
    # The lookup is by hash; compare again in constant time so that no timing of the
    # comparison itself depends on how much of a guessed token is right.
    if row is None or not hmac.compare_digest(row.token_hash, digest) or row.revoked_at is not None:
        raise AuthenticationError("invalid or revoked token")
    return Principal(id=row.id, name=row.name, role=Role(row.role))


def write_secret_file(path: Path, content: str) -> None:
    """Write ``content`` to ``path`` with mode 0600, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, content.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def ensure_bootstrap_token(session: Session, path: Path, role: Role, name: str) -> str | None:
    """At first start, create a token of ``role`` and write it to ``path`` (mode 0600).

    Returns the new token, or None when a usable one is already recorded in ``path``.
    """
    if path.exists():
        existing = path.read_text().strip()
        row = session.scalars(select(Token).where(Token.token_hash == hash_token(existing))).first()
        if row is not None and row.revoked_at is None and row.role == role.value:
            return None
    _row, plain = create_token(session, name, role)
    write_secret_file(path, plain + "\n")
    log.info("created the %s token %r in %s", role.value, name, path)
    return plain
