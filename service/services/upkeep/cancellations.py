"""Cancellations with nothing left to stop: a cancelling job whose remaining placements were
never claimed (no process to stop) or are all done becomes ``cancelled``."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.engine import Database
from service.db.models import Job, Placement
from service.db.types import utcnow
from service.services.attempt_outcomes import finish_cancellation, locked_job
from service.services.transitions import set_placement_status
from service.states import JobStatus, PlacementStatus


def settle_cancellations(db: Database) -> list[str]:
    """Settle every cancelling job that can be, each in a transaction of its own; the ids of
    the jobs cancelled here."""
    with db.read_session() as session:
        cancelling = list(session.scalars(select(Job.id).where(Job.status == JobStatus.CANCELLING)))
    cancelled: list[str] = []
    for job_id in cancelling:
        with db.transaction() as session:
            if _settle_cancel(session, job_id):
                cancelled.append(job_id)
    return cancelled


def _settle_cancel(session: Session, job_id: str) -> bool:
    job = locked_job(session, job_id)
    if job.status != JobStatus.CANCELLING:
        return False
    now = utcnow()
    for placement in session.scalars(
        select(Placement)
        .where(Placement.job_id == job_id, Placement.status == PlacementStatus.ASSIGNED)
        .order_by(Placement.id)
        .with_for_update()
    ):
        # Never claimed: no process exists to stop.
        set_placement_status(placement, PlacementStatus.DONE, now)
    return finish_cancellation(session, job)
