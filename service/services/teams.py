"""Users and teams (docs/teams.md): who a token acts for, which teams they are in, and the
teams' quotas per resource pool. Admission against the quotas is :mod:`fair_share`'s.

A user owns tokens and belongs to teams, the first of which is their default. A user or
admin token created without naming a user gets a user of its own, named as the token (with
a ``-2``, ``-3``... when that name is taken), in the team ``default``: one token, one owner,
as before teams existed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from service.db.models import Attempt, Job, Team, TeamMember, TeamQuota, Token, User
from service.db.types import utcnow
from service.services.tokens import DEFAULT_TEAM, Principal, default_team
from service.states import LIVE_ATTEMPT_STATUSES
from torchyard.contract.errors import ConflictError, NotFoundError, RequestValidationError

DEFAULT_POOL = "default"
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,99}$")


@dataclass(frozen=True)
class QuotaSpec:
    pool: str
    nominal: int
    borrowing_limit: int | None = None
    lending_limit: int | None = None


def check_name(name: str, what: str) -> str:
    if not _NAME.match(name):
        raise RequestValidationError(
            f"a {what} name is 1 to 100 lowercase letters, digits, '.', '_' or '-', starting with a "
            f"letter or digit; not {name!r}"
        )
    return name


# --- users ---------------------------------------------------------------------------------


def find_user(session: Session, name: str) -> User:
    user = session.scalars(select(User).where(User.name == name)).first()
    if user is None:
        raise NotFoundError(f"user {name!r} not found")
    return user


def find_team(session: Session, name: str, *, for_update: bool = False) -> Team:
    stmt = select(Team).where(Team.name == name)
    team = session.scalars(stmt.with_for_update() if for_update else stmt).first()
    if team is None:
        raise NotFoundError(f"team {name!r} not found")
    return team


def _teams_named(session: Session, names: Sequence[str]) -> list[Team]:
    found = {t.name: t for t in session.scalars(select(Team).where(Team.name.in_(names)))}
    missing = [n for n in names if n not in found]
    if missing:
        raise RequestValidationError(f"no team named {', '.join(map(repr, missing))}")
    return [found[n] for n in names]


def set_membership(session: Session, user: User, team_names: Sequence[str]) -> None:
    if len(set(team_names)) != len(team_names):
        raise RequestValidationError("a team is named twice")
    teams = _teams_named(session, team_names)
    session.execute(delete(TeamMember).where(TeamMember.user_id == user.id))
    for position, team in enumerate(teams):
        session.add(TeamMember(team_id=team.id, user_id=user.id, position=position))


def create_user(session: Session, name: str, team_names: Sequence[str], admin: bool) -> User:
    check_name(name, "user")
    if session.scalars(select(User.id).where(User.name == name)).first() is not None:
        raise ConflictError(f"user {name!r} exists")
    user = User(name=name, admin=admin, created_at=utcnow())
    session.add(user)
    session.flush()
    set_membership(session, user, list(team_names) or [DEFAULT_TEAM])
    return user


def user_teams(session: Session, user_id: str) -> list[str]:
    return list(
        session.scalars(
            select(Team.name)
            .join(TeamMember, TeamMember.team_id == Team.id)
            .where(TeamMember.user_id == user_id)
            .order_by(TeamMember.position, Team.name)
        )
    )


def disable_user(session: Session, user: User, disabled: bool) -> None:
    """A disabled user's tokens stop working at once (every request reads it)."""
    user.disabled_at = utcnow() if disabled else None


# --- teams ---------------------------------------------------------------------------------


def set_quotas(session: Session, team: Team, quotas: Sequence[QuotaSpec]) -> None:
    pools = [q.pool for q in quotas]
    if len(set(pools)) != len(pools):
        raise RequestValidationError("a pool is named twice")
    session.execute(delete(TeamQuota).where(TeamQuota.team_id == team.id))
    for q in quotas:
        session.add(
            TeamQuota(
                team_id=team.id,
                pool=q.pool,
                nominal=q.nominal,
                borrowing_limit=q.borrowing_limit,
                lending_limit=q.lending_limit,
            )
        )


def create_team(session: Session, name: str, quotas: Sequence[QuotaSpec], **options: object) -> Team:
    check_name(name, "team")
    if session.scalars(select(Team.id).where(Team.name == name)).first() is not None:
        raise ConflictError(f"team {name!r} exists")
    team = Team(name=name, created_at=utcnow(), **options)
    session.add(team)
    session.flush()
    set_quotas(session, team, quotas)
    return team


def quotas_of(session: Session, team_id: str) -> list[TeamQuota]:
    return list(
        session.scalars(select(TeamQuota).where(TeamQuota.team_id == team_id).order_by(TeamQuota.pool))
    )


def usage(session: Session) -> dict[tuple[str, str], int]:
    """Units held now by each team in each pool: (team id, pool) -> the units of its live
    attempts (an attempt holds its job's nodes × processes from its hand-over, before an
    engine that schedules has bound any placement, until it ends; every pool is ``default``
    for now: docs/teams.md)."""
    rows = session.execute(
        select(Job.team_id, func.coalesce(func.sum(Job.node_count * Job.process_count_per_node), 0))
        .join(Attempt, Attempt.job_id == Job.id)
        .where(Attempt.status.in_(LIVE_ATTEMPT_STATUSES))
        .group_by(Job.team_id)
    ).all()
    return {(team_id or "", DEFAULT_POOL): int(units) for team_id, units in rows}


def team_for_submission(session: Session, principal: Principal, requested: str | None) -> str | None:
    """The team a submission belongs to: the one asked for (one of the user's teams; else 422),
    or the user's first. Tokens without a user (none can submit) and admins asking for any
    team: an admin may submit to any team."""
    if requested is None:
        if principal.team_ids:
            return principal.team_ids[0]
        return default_team(session).id if principal.user_id is not None else None
    if requested in principal.team_names:
        return principal.team_ids[principal.team_names.index(requested)]
    if principal.is_admin:
        return find_team(session, requested).id
    raise RequestValidationError(
        f"you are not in team {requested!r}: your teams are {', '.join(principal.team_names) or 'none'}",
        details={"teams": list(principal.team_names)},
    )


def token_user_names(session: Session, token_ids: Sequence[str]) -> dict[str, str]:
    """The user names of tokens (for the admin's token list)."""
    rows = session.execute(
        select(Token.id, User.name).join(User, User.id == Token.user_id).where(Token.id.in_(token_ids))
    ).all()
    return {token_id: name for token_id, name in rows}


def pool_usage(ledger_teams: dict[str, Any], team_id: str, pool: str) -> dict[str, Any]:
    """A team's use of its quota in ``pool``: units held, borrowed (past its nominal) and lent
    (of its idle nominal, what other teams' borrowing takes)."""
    team = ledger_teams[team_id]
    quota = team.quota(pool)
    used = team.used.get(pool, 0)
    borrowed_by_others = sum(
        max(0, t.used.get(pool, 0) - t.quota(pool).nominal)
        for key, t in ledger_teams.items()
        if key != team_id
    )
    return {
        "pool": pool,
        "used": used,
        "nominal": quota.nominal,
        "borrowing_limit": quota.borrowing_limit,
        "lending_limit": quota.lending_limit,
        "borrowed": max(0, used - quota.nominal),
        "lent": min(max(0, quota.nominal - used), borrowed_by_others),
    }


def members_of(session: Session, team_id: str) -> list[str]:
    return list(
        session.scalars(
            select(User.name)
            .join(TeamMember, TeamMember.user_id == User.id)
            .where(TeamMember.team_id == team_id)
            .order_by(User.name)
        )
    )


def visible_team(session: Session, principal: Principal, name: str) -> Team:
    """A team the principal may look at: any for an admin, their own for others (else 404)."""
    team = find_team(session, name)
    if not principal.is_admin and team.id not in principal.team_ids:
        raise NotFoundError(f"team {name!r} not found")
    return team
