"""Runtime limits: a running job past its ``resources.max_runtime_s`` fails with
``TimeoutError``, and its nodes stop their ranks at their next heartbeat."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.engine import Database
from service.db.models import Job
from service.services.attempt_outcomes import fail_attempt, locked_job, locked_live_attempts
from service.services.jobs import transition
from service.states import JobStatus
from torchyard.contract.errors import JobTimeoutError
from torchyard.contract.failures import Failure

log = logging.getLogger(__name__)


def overrun_limit_s(spec: dict[str, Any] | None, started_at: datetime | None, now: datetime) -> int | None:
    """The job's ``resources.max_runtime_s`` if a job that started at ``started_at`` has
    reached it by ``now``; None when it has no limit, has not started or is within it."""
    limit = ((spec or {}).get("resources") or {}).get("max_runtime_s")
    if limit is None or started_at is None or started_at + timedelta(seconds=limit) > now:
        return None
    return int(limit)


def time_out(session: Session, job_id: str, now: datetime) -> bool:
    """Fail a running job that has outrun its ``max_runtime_s`` with ``TimeoutError``.

    Its live attempt fails with it, so every node is told to stop its ranks at its next
    heartbeat (as when a rank fails elsewhere). Re-checked under the job's lock; True if
    the job was timed out here.
    """
    job = locked_job(session, job_id)
    limit = overrun_limit_s(job.spec, job.started_at, now)
    if job.status != JobStatus.RUNNING or limit is None:
        return False
    message = f"the job ran longer than its limit of {limit} s (resources.max_runtime_s)"
    failure = Failure(code=JobTimeoutError.code, message=message)
    for attempt in locked_live_attempts(session, job.id):
        fail_attempt(session, job, attempt, failure, f"{JobTimeoutError.code}: {message}")
    if job.status == JobStatus.RUNNING:  # no live attempt left to fail with it
        transition(session, job, JobStatus.FAILED, f"{JobTimeoutError.code}: {message}", failure=failure)
    return True


def time_out_overruns(db: Database, now: datetime) -> list[str]:
    """Time out every running job past its runtime limit, each in a transaction of its own;
    the ids of the jobs timed out here."""
    with db.read_session() as session:
        running = session.execute(
            select(Job.id, Job.started_at, Job.spec).where(Job.status == JobStatus.RUNNING)
        ).all()
    timed_out: list[str] = []
    for job_id, started_at, spec in running:
        limit = overrun_limit_s(spec, started_at, now)
        if limit is None:
            continue  # checked before taking the write lock; time_out checks again under it
        with db.transaction() as session:
            if time_out(session, job_id, now):
                timed_out.append(job_id)
                log.warning("job %s timed out after %s s", job_id, limit)
    return timed_out
