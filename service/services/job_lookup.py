"""Finding a job a principal may see, by id, name or id prefix (below every service that
reads one: the kinds, artifacts, outputs, models), and who may read or change a job.

A job is read (looked at, listed, streamed, its metrics, logs, model and outputs fetched,
cloned) by its owner's user, by the members of its team (docs/teams.md; not of the team
``default``, which is everyone's) and by admins; it is changed (cancelled, deleted, its tags
and note replaced, its model registered) by its owner's user and by admins only. A job the
principal may not read is a 404; one it may read but not change is a 403.
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, or_, select
from sqlalchemy.orm import Session

from service.db.models import Job
from service.services import refs
from service.services.ownership import owned, owns, sharing_teams
from service.services.tokens import Principal
from torchyard.contract.errors import NotFoundError, PermissionDeniedError


def owned_jobs(principal: Principal) -> list[ColumnElement[bool]]:
    """The conditions that keep the jobs the principal may change: its user's (any for an admin)."""
    return owned(principal, Job.owner_id)


def readable_jobs(principal: Principal) -> list[ColumnElement[bool]]:
    """The conditions that keep the jobs the principal may read: its user's and its teams'
    (any for an admin)."""
    if principal.is_admin:
        return []
    teams = sharing_teams(principal)
    if not teams:
        return owned_jobs(principal)
    return [or_(Job.owner_id.in_(principal.owners), Job.team_id.in_(teams))]


def may_read(principal: Principal, owner_id: str, team_id: str | None) -> bool:
    """Whether the principal may read a job made by ``owner_id`` in team ``team_id``."""
    return owns(principal, owner_id) or (team_id is not None and team_id in sharing_teams(principal))


def get_job(
    session: Session, principal: Principal, job_id: str, *, for_update: bool = False, write: bool = False
) -> Job:
    """The job, if the principal may read it; a job it may not read is a 404. With
    ``write``, a job it may read but not change (a teammate's) is a 403.

    ``job_id`` may also be the job's name or a unique prefix of its id, among the jobs
    the principal may read (see :mod:`service.services.refs`)."""

    def by_id(wanted: str) -> Job | None:
        stmt = select(Job).where(Job.id == wanted, Job.deleted_at.is_(None))
        return session.scalars(stmt.with_for_update() if for_update else stmt).first()

    job = by_id(job_id) if refs.comparable(job_id) else None
    if job is None or not may_read(principal, job.owner_id, job.team_id):
        visible: list[ColumnElement[bool]] = [Job.deleted_at.is_(None), *readable_jobs(principal)]
        found = refs.resolve(session, Job, visible, job_id, "job")
        job = None if found is None else by_id(found)
        if job is None:
            raise NotFoundError(
                f"job {job_id!r} not found (no job you may see has this id, name or id prefix)"
                + refs.not_found_hint(job_id)
            )
    if write and not owns(principal, job.owner_id):
        raise PermissionDeniedError(
            f"job {job.id} is a job of your team: you may read it, but only its owner may change it",
            details={"job": job.id},
        )
    return job
