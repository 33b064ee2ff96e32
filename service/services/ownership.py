"""Who owns what (docs/teams.md).

A row's ``owner_id`` is the token that made it, and the row belongs to that token's user:
every token of the user owns it (``Principal.owners``). A token without a user owns only
what it made itself. An admin owns everything. Teams give their members read access to
each other's jobs (:mod:`service.services.job_lookup`), nothing more.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import Session

from service.db.models import Token
from service.services.tokens import DEFAULT_TEAM, Principal


def owned(principal: Principal, owner_column: Any) -> list[ColumnElement[bool]]:
    """The conditions that keep the principal's own rows (by ``owner_column``, a model's
    ``owner_id``): none for an admin. ``IN`` of one token is what ``=`` was: the same index."""
    if principal.is_admin:
        return []
    return [owner_column.in_(principal.owners)]


def owns(principal: Principal, owner_id: str) -> bool:
    """Whether a row made by the token ``owner_id`` is the principal's own (or it is an admin)."""
    return principal.is_admin or owner_id in principal.owners


def sharing_teams(principal: Principal) -> tuple[str, ...]:
    """The ids of the teams whose jobs the principal may read: its teams but ``default``,
    which every user is put in and which therefore shares nothing."""
    return tuple(
        team_id
        for team_id, name in zip(principal.team_ids, principal.team_names, strict=True)
        if name != DEFAULT_TEAM
    )


def first_team(principal: Principal) -> str | None:
    """The team a new dataset, code package or model version belongs to: the user's first."""
    return principal.team_ids[0] if principal.team_ids else None


def owner_tokens(session: Session, token_id: str) -> tuple[str, ...]:
    """Every token of ``token_id``'s user (the token alone when it has no user): the owners
    of what that token made."""
    user_id = session.scalar(select(Token.user_id).where(Token.id == token_id))
    if user_id is None:
        return (token_id,)
    return tuple(session.scalars(select(Token.id).where(Token.user_id == user_id).order_by(Token.id)))
