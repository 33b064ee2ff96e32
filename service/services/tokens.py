"""API tokens: created once, stored only as a hash, compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import bindparam, or_, select, update
from sqlalchemy.orm import Session

from service.db.models import Team, TeamMember, Token, User
from service.db.types import utcnow
from service.states import Role
from torchyard.contract.errors import (
    AuthenticationError,
    ConflictError,
    NotFoundError,
    RequestValidationError,
)

log = logging.getLogger(__name__)

TOKEN_PREFIX = "ty_"
# ``last_used_at`` is refreshed at most this often per token: one write a minute, not one a request.
LAST_USED_RESOLUTION = timedelta(minutes=1)


@dataclass(frozen=True)
class Principal:
    """Who is asking: a token's id, name and role."""

    id: str
    name: str
    role: Role
    last_used_at: datetime | None = field(default=None, compare=False)
    # A launch token's attempt (docs/slurm.md): it speaks only for that attempt's placements.
    attempt_id: str | None = None
    # The user the token acts for (docs/teams.md), the ids of every token of that user (what
    # they own is what any of them made), and their teams (the first is their default).
    user_id: str | None = None
    owner_ids: tuple[str, ...] = ()
    team_ids: tuple[str, ...] = ()
    team_names: tuple[str, ...] = ()
    # A web sign-in through the OpenID provider (docs/oidc.md): its server-side session.
    session_id: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.role is Role.ADMIN

    @property
    def owners(self) -> tuple[str, ...]:
        """The token ids whose rows this principal owns: its user's tokens, or itself."""
        return self.owner_ids or (self.id,)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


DEFAULT_TEAM = "default"


def default_team(session: Session) -> Team:
    """The team ``default`` (made by the migration; made again here if it was deleted)."""
    team = session.scalars(select(Team).where(Team.name == DEFAULT_TEAM)).first()
    if team is None:
        team = Team(name=DEFAULT_TEAM, created_at=utcnow())
        session.add(team)
        session.flush()
    return team


def _free_user_name(session: Session, name: str) -> str:
    taken = set(session.scalars(select(User.name).where(User.name.like(f"{name}%"))))
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        candidate = f"{name}-{n}"
    return candidate


def user_for_new_token(session: Session, token_name: str, role: Role, user_name: str | None) -> str | None:
    """The user a new token acts for: the named one, or a new user of the token's own (see the
    module's docstring); None for worker tokens."""
    if role not in (Role.USER, Role.ADMIN):
        if user_name is not None:
            raise RequestValidationError("only user and admin tokens act for a user")
        return None
    if user_name is not None:
        user = session.scalars(select(User).where(User.name == user_name)).first()
        if user is None:
            raise RequestValidationError(f"no user named {user_name!r}")
        if role is Role.ADMIN and not user.admin:
            raise RequestValidationError(f"user {user_name!r} is not an admin: an admin token needs one")
        return user.id
    user = User(
        name=_free_user_name(session, token_name[:190]), admin=role is Role.ADMIN, created_at=utcnow()
    )
    session.add(user)
    session.flush()
    session.add(TeamMember(team_id=default_team(session).id, user_id=user.id, position=0))
    return user.id


def create_token(session: Session, name: str, role: Role, user: str | None = None) -> tuple[Token, str]:
    """Create a token; the plain value is returned once and never stored. A user or admin
    token acts for ``user``, or for a new user of its own (docs/teams.md)."""
    plain = TOKEN_PREFIX + secrets.token_urlsafe(32)
    user_id = user_for_new_token(session, name, role, user)
    row = Token(name=name, role=role, token_hash=hash_token(plain), user_id=user_id)
    session.add(row)
    session.flush()
    return row, plain


# Run on every request: the columns only (no Token object), in a statement built once.
_BY_HASH = select(
    Token.id,
    Token.name,
    Token.role,
    Token.token_hash,
    Token.revoked_at,
    Token.last_used_at,
    Token.attempt_id,
    Token.user_id,
).where(Token.token_hash == bindparam("digest"))
_USER_TOKENS = select(Token.id).where(Token.user_id == bindparam("user")).order_by(Token.id)
_USER_TEAMS = (
    select(Team.id, Team.name)
    .join(TeamMember, TeamMember.team_id == Team.id)
    .where(TeamMember.user_id == bindparam("user"))
    .order_by(TeamMember.position, Team.name)
)
_USER_STATE = select(User.disabled_at).where(User.id == bindparam("user"))


def authenticate(session: Session, token: str | None) -> Principal:
    """The principal behind ``token``, read from the database on every request.

    Nothing is cached in the process: a token revoked through any API replica is refused
    by every replica from its next request on.
    """
    if not token:
        raise AuthenticationError("missing bearer token (Authorization: Bearer <token>)")
    digest = hash_token(token)
    row = session.execute(_BY_HASH, {"digest": digest}).first()
    # The lookup is by hash; compare again in constant time so that no timing of the
    # comparison itself depends on how much of a guessed token is right.
    if row is None or not hmac.compare_digest(row.token_hash, digest) or row.revoked_at is not None:
        raise AuthenticationError("invalid or revoked token")
    if row.user_id is None:
        return Principal(
            id=row.id, name=row.name, role=row.role, last_used_at=row.last_used_at, attempt_id=row.attempt_id
        )
    params = {"user": row.user_id}
    if session.execute(_USER_STATE, params).scalar_one_or_none() is not None:
        raise AuthenticationError("invalid or revoked token")  # its user is disabled
    teams = session.execute(_USER_TEAMS, params).all()
    return Principal(
        id=row.id,
        name=row.name,
        role=row.role,
        last_used_at=row.last_used_at,
        attempt_id=row.attempt_id,
        user_id=row.user_id,
        owner_ids=tuple(session.scalars(_USER_TOKENS, params)),
        team_ids=tuple(t.id for t in teams),
        team_names=tuple(t.name for t in teams),
    )


def use_is_due(principal: Principal, now: datetime) -> bool:
    """Whether this request should refresh the token's ``last_used_at``."""
    last = principal.last_used_at
    return last is None or now - last >= LAST_USED_RESOLUTION


class UseRecorder:
    """Lets one request of this process write a token's ``last_used_at`` when it is due.

    Requests arriving together all read the same stale value; without this, each would
    open a write transaction for an UPDATE that only the first one needs. It never
    decides who is authenticated: that is read from the database on every request.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # token id -> the stale last_used_at a write was started for
        self._started: dict[str, datetime | None] = {}

    def should_record(self, principal: Principal, now: datetime) -> bool:
        if not use_is_due(principal, now):
            return False
        with self._lock:
            if principal.id in self._started and self._started[principal.id] == principal.last_used_at:
                return False
            self._started[principal.id] = principal.last_used_at
            return True

    def failed(self, token_id: str) -> None:
        """The write did not happen: let the next request try again."""
        with self._lock:
            self._started.pop(token_id, None)


USE_RECORDER = UseRecorder()


def record_use(session: Session, token_id: str, now: datetime) -> bool:
    """Set ``last_used_at`` unless another request did within the resolution; the caller commits.

    The condition lives in the UPDATE itself, so replicas racing on one token write once.
    """
    result = session.execute(
        update(Token)
        .where(
            Token.id == token_id,
            or_(Token.last_used_at.is_(None), Token.last_used_at <= now - LAST_USED_RESOLUTION),
        )
        .values(last_used_at=now)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(result, "rowcount", 0))


def list_tokens(session: Session, *, include_revoked: bool = True) -> list[Token]:
    """Every token, oldest first."""
    # Launch tokens live and die with their attempt: they are not the admin's to manage.
    stmt = select(Token).where(Token.attempt_id.is_(None)).order_by(Token.created_at, Token.id)
    if not include_revoked:
        stmt = stmt.where(Token.revoked_at.is_(None))
    return list(session.scalars(stmt))


def issue_token(session: Session, name: str, role: Role, user: str | None = None) -> tuple[Token, str]:
    """Create a token and commit; the plain secret is returned once, never stored."""
    row, plain = create_token(session, name, role, user)
    session.commit()
    return row, plain


def revoke_token(session: Session, token_id: str) -> Token:
    """Revoke a token and commit: from now on every request carrying it is a 401. Idempotent.

    The last admin token that is not revoked cannot be revoked (nobody could create or
    revoke tokens through the API any more); create another admin token first.
    """
    role = session.scalar(select(Token.role).where(Token.id == token_id))
    if role is None:
        raise NotFoundError(f"token {token_id!r} not found")
    live_admins: list[str] = []
    if role == Role.ADMIN:
        # Lock every live admin row, in one order for everyone, before the target: two
        # revocations racing then queue instead of both seeing another admin left.
        live_admins = list(
            session.scalars(
                select(Token.id)
                .where(Token.role == Role.ADMIN, Token.revoked_at.is_(None))
                .order_by(Token.id)
                .with_for_update()
            )
        )
    row = session.scalars(
        select(Token).where(Token.id == token_id).with_for_update().execution_options(populate_existing=True)
    ).one()
    if row.revoked_at is not None:
        return row
    if role == Role.ADMIN and live_admins == [row.id]:
        raise ConflictError(
            f"token {token_id!r} is the last admin token that is not revoked; "
            "create another admin token before revoking it"
        )
    row.revoked_at = utcnow()
    session.commit()
    return row


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
        if row is not None and row.revoked_at is None and row.role == role:
            return None
    _row, plain = create_token(session, name, role)
    write_secret_file(path, plain + "\n")
    log.info("created the %s token %r in %s", role, name, path)
    return plain
