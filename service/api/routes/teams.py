"""Users, teams and the queue (docs/teams.md).

* ``POST /v1/teams``, ``PATCH /v1/teams/{name}`` (admins): a team, its quotas per pool, its
  fair-share weight; a change takes effect at the next scheduling pass;
* ``GET /v1/teams``, ``GET /v1/teams/{name}``: quotas and usage now (admins: every team;
  others: their own teams);
* ``GET /v1/teams/{name}/usage``: its use of its quota over time, sampled once a minute;
* ``POST /v1/users``, ``GET /v1/users``, ``PATCH /v1/users/{name}`` (admins);
* ``GET /v1/queue``: the waiting jobs in the order of the next pass, with their team's use
  of its quota and why each waits (admins: all; others: their teams' jobs).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Query, status
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.api.deps import AdminUser, CurrentUser, ReadSessionDep, SchedulingDep, SessionDep, SettingsDep
from service.api.routing import SessionScopedRoute
from service.db.models import Team, User
from service.db.types import utcnow
from service.schemas.teams import (
    PoolUsage,
    QueuedPublic,
    QueueList,
    QuotaBody,
    TeamCreate,
    TeamList,
    TeamPublic,
    TeamUpdate,
    TeamUsageSeries,
    UsagePoint,
    UserCreate,
    UserList,
    UserPublic,
    UserUpdate,
)
from service.services import team_usage, teams
from service.services.cluster import ready_capacity
from service.services.fair_share import Ledger, admission_order, load_ledger
from service.services.job_lookup import may_read
from service.services.scheduler import unit_word
from service.services.teams import DEFAULT_POOL, QuotaSpec
from torchyard.contract.errors import RequestValidationError

router = APIRouter(tags=["teams"], route_class=SessionScopedRoute)


def _ledger(session: Session, settings: SettingsDep) -> tuple[Ledger, str]:
    nodes = ready_capacity(session, settings, utcnow())
    word = unit_word(nodes)
    return load_ledger(session, {DEFAULT_POOL: sum(n.units for n in nodes)}, word), word


def _team_public(session: Session, ledger: Ledger, team: Team) -> TeamPublic:
    quotas = teams.quotas_of(session, team.id)
    pools = sorted({q.pool for q in quotas} | set(ledger.book(team.id).used) | {DEFAULT_POOL})
    return TeamPublic(
        name=team.name,
        weight=team.weight,
        preempt_within=team.preempt_within,
        slurm_account=team.slurm_account,
        kueue_queue=team.kueue_queue,
        quotas=[
            QuotaBody(
                pool=q.pool,
                nominal=q.nominal,
                borrowing_limit=q.borrowing_limit,
                lending_limit=q.lending_limit,
            )
            for q in quotas
        ],
        usage=[PoolUsage(**teams.pool_usage(ledger.teams, team.id, pool)) for pool in pools],
        members=teams.members_of(session, team.id),
        created_at=team.created_at,
    )


def _specs(quotas: list[QuotaBody]) -> list[QuotaSpec]:
    return [QuotaSpec(q.pool, q.nominal, q.borrowing_limit, q.lending_limit) for q in quotas]


@router.post("/v1/teams", status_code=status.HTTP_201_CREATED)
def create_team(
    body: TeamCreate, session: SessionDep, settings: SettingsDep, scheduling: SchedulingDep, _admin: AdminUser
) -> TeamPublic:
    """Create a team with its quotas (admins). 409 when the name is taken."""
    team = teams.create_team(
        session,
        body.name,
        _specs(body.quotas),
        weight=body.weight,
        preempt_within=body.preempt_within,
        slurm_account=body.slurm_account,
        kueue_queue=body.kueue_queue,
    )
    session.commit()
    scheduling.request()
    ledger, _ = _ledger(session, settings)
    return _team_public(session, ledger, team)


@router.patch("/v1/teams/{name}")
def update_team(
    name: str,
    body: TeamUpdate,
    session: SessionDep,
    settings: SettingsDep,
    scheduling: SchedulingDep,
    _admin: AdminUser,
) -> TeamPublic:
    """Change a team's quotas (replaced whole when given), weight or options (admins); the
    next scheduling pass admits and reclaims by them."""
    team = teams.find_team(session, name, for_update=True)
    given = body.model_fields_set
    if body.quotas is not None:
        teams.set_quotas(session, team, _specs(body.quotas))
    if body.weight is not None:
        team.weight = body.weight
    if body.preempt_within is not None:
        team.preempt_within = body.preempt_within
    if "slurm_account" in given:
        team.slurm_account = body.slurm_account or None
    if "kueue_queue" in given:
        team.kueue_queue = body.kueue_queue or None
    session.commit()
    scheduling.request()
    ledger, _ = _ledger(session, settings)
    return _team_public(session, ledger, team)


@router.get("/v1/teams")
def list_teams(session: ReadSessionDep, settings: SettingsDep, principal: CurrentUser) -> TeamList:
    """The teams with their quotas and usage (admins: all; others: their own)."""
    ledger, _ = _ledger(session, settings)
    rows = session.scalars(select(Team).order_by(Team.name)).all()
    visible = [t for t in rows if principal.is_admin or t.id in principal.team_ids]
    return TeamList(items=[_team_public(session, ledger, t) for t in visible])


@router.get("/v1/teams/{name}")
def get_team(name: str, session: ReadSessionDep, settings: SettingsDep, principal: CurrentUser) -> TeamPublic:
    """A team's quotas and its use of them now (another team's, for a non-admin: 404)."""
    team = teams.visible_team(session, principal, name)
    ledger, _ = _ledger(session, settings)
    return _team_public(session, ledger, team)


@router.get("/v1/teams/{name}/usage")
def get_team_usage(
    name: str,
    session: ReadSessionDep,
    principal: CurrentUser,
    since: Annotated[
        datetime | None,
        Query(description="The first sample's earliest time (ISO 8601, with a zone); default: a day ago."),
    ] = None,
    pool: Annotated[str, Query(min_length=1, max_length=100)] = DEFAULT_POOL,
) -> TeamUsageSeries:
    """A team's use of its quota in ``pool`` over time, a sample a minute (another team's,
    for a non-admin: 404)."""
    team = teams.visible_team(session, principal, name)
    if since is None:
        since = utcnow() - timedelta(days=1)
    elif since.tzinfo is None:
        raise RequestValidationError(
            "since needs a time zone, e.g. 2026-01-02T03:04:05Z", details={"field": "since"}
        )
    rows = team_usage.points(session, team.id, pool, since)
    return TeamUsageSeries(
        team=team.name,
        pool=pool,
        items=[
            UsagePoint(at=r.at, used=r.used, nominal=r.nominal, borrowed=r.borrowed, lent=r.lent)
            for r in rows
        ],
    )


def _user_public(session: Session, user: User) -> UserPublic:
    return UserPublic(
        name=user.name,
        admin=user.admin,
        teams=teams.user_teams(session, user.id),
        disabled=user.disabled_at is not None,
        created_at=user.created_at,
    )


@router.post("/v1/users", status_code=status.HTTP_201_CREATED)
def create_user(body: UserCreate, session: SessionDep, _admin: AdminUser) -> UserPublic:
    """Create a user in teams (the first is their default; none: ``default``). Give them
    tokens with ``POST /v1/tokens {"user": name}``."""
    user = teams.create_user(session, body.name, body.teams, body.admin)
    session.commit()
    return _user_public(session, user)


@router.get("/v1/users")
def list_users(session: ReadSessionDep, _admin: AdminUser) -> UserList:
    users = session.scalars(select(User).order_by(User.name)).all()
    return UserList(items=[_user_public(session, u) for u in users])


@router.patch("/v1/users/{name}")
def update_user(name: str, body: UserUpdate, session: SessionDep, _admin: AdminUser) -> UserPublic:
    """Change a user's teams (their next request sees it), admin flag, or disable them (their
    tokens stop working at once)."""
    user = teams.find_user(session, name)
    if body.teams is not None:
        teams.set_membership(session, user, body.teams)
    if body.admin is not None:
        user.admin = body.admin
    if body.disabled is not None:
        teams.disable_user(session, user, body.disabled)
    session.commit()
    return _user_public(session, user)


@router.get("/v1/queue")
def queue(session: ReadSessionDep, settings: SettingsDep, principal: CurrentUser) -> QueueList:
    """Waiting jobs in the order the next scheduling pass considers them, each with its
    position, team, the team's use of its quota and why it waits."""
    nodes = ready_capacity(session, settings, utcnow())
    ledger, order = admission_order(session, {DEFAULT_POOL: sum(n.units for n in nodes)}, unit_word(nodes))
    items = []
    for position, entry in enumerate(order, start=1):
        job = entry.job
        if not may_read(principal, job.owner_id, job.team_id):
            continue
        usage = (
            PoolUsage(**teams.pool_usage(ledger.teams, entry.team.id, DEFAULT_POOL)) if job.team_id else None
        )
        items.append(
            QueuedPublic(
                position=position,
                id=job.id,
                name=job.name,
                team=entry.team.name if job.team_id else None,
                priority=job.priority,
                units=job.node_count * job.process_count_per_node,
                usage=usage,
                reason=job.wait_reason,
                created_at=job.created_at,
            )
        )
    return QueueList(items=items)
