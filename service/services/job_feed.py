"""Status changes of all the jobs a principal may read (its own, its teams'), for the jobs
list's live view.

One short read every interval, for the jobs whose ``updated_at`` moved; nothing is held
between reads. Per-job detail (metrics, logs) is the per-job events stream's business.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.db.engine import Database
from service.db.models import Job
from service.db.types import utcnow
from service.services.job_lookup import readable_jobs
from service.services.job_progress import progress_public
from service.services.kinds import kind_of
from service.services.tokens import Principal

LIST_POLL_INTERVAL_S = 1.0
LIST_KEEPALIVE_S = 15.0
MAX_CHANGES = 200


def _readable(principal: Principal) -> Any:
    return select(Job).where(Job.deleted_at.is_(None), *readable_jobs(principal))


def latest_update(session: Session, principal: Principal) -> datetime | None:
    stmt = select(func.max(Job.updated_at)).where(*readable_jobs(principal))
    value: datetime | None = session.scalar(stmt)
    return value


def changed_since(session: Session, principal: Principal, since: datetime | None) -> list[dict[str, Any]]:
    """The jobs the principal may read (its own, its teams') updated after ``since``, oldest
    change first, as list rows."""
    stmt = _readable(principal)
    if since is not None:
        stmt = stmt.where(Job.updated_at > since)
    rows = session.scalars(stmt.order_by(Job.updated_at).limit(MAX_CHANGES))
    now = utcnow()
    return [
        {
            "id": job.id,
            "type": job.type,
            "name": job.name,
            "status": job.status,
            "reason": job.wait_reason,
            "progress": progress_public(job.status, job.progress, now),
            "best": job.best,
            **kind_of(job).listed(job),
            "created_at": job.created_at.isoformat(),
            "updated_at": job.updated_at.isoformat(),
            "started_at": job.started_at.isoformat() if job.started_at else None,
            "finished_at": job.finished_at.isoformat() if job.finished_at else None,
        }
        for job in rows
    ]


def _read(db: Database, fn: Any, *args: Any) -> Any:
    with db.read_session() as session:
        return fn(session, *args)


async def job_changes(
    db: Database,
    principal: Principal,
    *,
    interval: float = LIST_POLL_INTERVAL_S,
    keepalive: float = LIST_KEEPALIVE_S,
) -> AsyncIterator[dict[str, Any] | None]:
    """Each change of the principal's jobs as a list row, until the client goes away; None
    after ``keepalive`` seconds without one (the stream says it is alive)."""
    since = await run_in_threadpool(_read, db, latest_update, principal)
    quiet = 0.0
    while True:
        await asyncio.sleep(interval)
        changes: list[dict[str, Any]] = await run_in_threadpool(_read, db, changed_since, principal, since)
        if changes:
            quiet = 0.0
            since = datetime.fromisoformat(changes[-1]["updated_at"])
            for change in changes:
                yield change
        else:
            quiet += interval
            if quiet >= keepalive:
                quiet = 0.0
                yield None
