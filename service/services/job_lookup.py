"""Finding a job a principal may see, by id, name or id prefix (below every service that
reads one: the kinds, artifacts, outputs, models)."""

from __future__ import annotations

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import Session

from service.db.models import Job
from service.services import refs
from service.services.tokens import Principal
from torchyard.contract.errors import NotFoundError


def get_job(session: Session, principal: Principal, job_id: str, *, for_update: bool = False) -> Job:
    """The job, if the principal may see it; another user's job is a 404.

    ``job_id`` may also be the job's name or a unique prefix of its id, among the jobs
    the principal may list (see :mod:`service.services.refs`)."""

    def by_id(wanted: str) -> Job | None:
        stmt = select(Job).where(Job.id == wanted, Job.deleted_at.is_(None))
        return session.scalars(stmt.with_for_update() if for_update else stmt).first()

    job = by_id(job_id) if refs.comparable(job_id) else None
    if job is None or (not principal.is_admin and job.owner_id != principal.id):
        visible: list[ColumnElement[bool]] = [Job.deleted_at.is_(None)]
        if not principal.is_admin:
            visible.append(Job.owner_id == principal.id)
        found = refs.resolve(session, Job, visible, job_id, "job")
        job = None if found is None else by_id(found)
        if job is None:
            raise NotFoundError(
                f"job {job_id!r} not found (no job you may see has this id, name or id prefix)"
                + refs.not_found_hint(job_id)
            )
    return job
