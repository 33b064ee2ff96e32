"""How an attempt ends, and what its job does then: failed (restarted or failed with it),
cancelled, preempted (back to the queue, no restart counted).

Every function here runs under the job's row lock (taken before any of its attempts and
placements, in that order), so the reports of several nodes of one attempt, the reaper of
any API replica, an engine's poll and a user's cancel serialise per job. The caller commits.
"""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session

from service.db.models import Attempt, Job, Placement
from service.db.types import utcnow
from service.engines import capabilities_of
from service.services.jobs import emit_job_event, transition
from service.services.transitions import set_attempt_status
from service.states import (
    LIVE_ATTEMPT_STATUSES,
    PLACED_STATUSES,
    AttemptStatus,
    JobStatus,
    PlacementStatus,
)
from torchyard.contract.errors import is_retryable
from torchyard.contract.failures import Failure
from torchyard.contract.jobspec import DEFAULT_MAX_RESTARTS

log = logging.getLogger(__name__)


def locked_job(session: Session, job_id: str) -> Job:
    """The job's row, locked (the first lock every writer of a job's rows takes)."""
    return session.scalars(select(Job).where(Job.id == job_id).with_for_update()).one()


def locked_attempt(session: Session, attempt_id: str) -> Attempt:
    """The attempt's row, locked (after its job's)."""
    return session.scalars(select(Attempt).where(Attempt.id == attempt_id).with_for_update()).one()


def locked_live_attempts(session: Session, job_id: str) -> list[Attempt]:
    """The job's live attempts, locked (after the job's row)."""
    return list(
        session.scalars(
            select(Attempt)
            .where(Attempt.job_id == job_id, Attempt.status.in_(LIVE_ATTEMPT_STATUSES))
            .with_for_update()
        )
    )


def open_placements(session: Session, which: ColumnElement[bool]) -> int:
    """How many of the placements ``which`` selects are not done yet."""
    count = session.scalar(
        select(func.count(Placement.id)).where(which, Placement.status != PlacementStatus.DONE)
    )
    return int(count or 0)


def end_attempt(
    attempt: Attempt, status: AttemptStatus, now: datetime, failure: Failure | None = None
) -> None:
    """End ``attempt`` with ``status`` at ``now``, and the failure that ended it."""
    set_attempt_status(attempt, status, now)
    if failure is not None:
        attempt.failure_code = failure.code
        attempt.failure_message = failure.message


def fail_attempt(session: Session, job: Job, attempt: Attempt, failure: Failure, message: str) -> None:
    """Fail a live attempt and, unless it is being cancelled, its job (first failure wins).

    A retryable failure (docs/restarts.md, ``RETRYABLE_FAILURES``) with restarts left puts the job back
    to ``queued`` instead (see :func:`restart_verdict`). An attempt that already ended (a late
    report of a node of an attempt that failed elsewhere) changes nothing of the job: the job
    may already run a newer attempt.
    """
    if attempt.status not in LIVE_ATTEMPT_STATUSES:
        return
    now = utcnow()
    end_attempt(attempt, AttemptStatus.FAILED, now, failure)
    if job.status not in PLACED_STATUSES or job.failure_code is not None:
        return
    restart = restart_verdict(session, job, attempt, failure)
    if restart is None:
        transition(session, job, JobStatus.FAILED, message, failure=failure)
        return
    job.restarts = (job.restarts or 0) + 1
    requeue(session, job, restart)
    log.warning("job %s: %s", job.id, restart)


def max_restarts(job: Job) -> int:
    value = ((job.spec or {}).get("resources") or {}).get("max_restarts", DEFAULT_MAX_RESTARTS)
    return int(value)


def restart_verdict(session: Session, job: Job, attempt: Attempt, failure: Failure) -> str | None:
    """The requeue reason if ``failure`` ending ``attempt`` earns a restart, else None (final).

    A restart needs a retryable code, a restart left, and a failure other than the previous
    attempt's (the same code and message on two attempts in a row is final).
    """
    if not is_retryable(failure.code):
        return None
    allowed = max_restarts(job)
    used = job.restarts or 0
    if used >= allowed:
        return None
    previous = session.scalars(
        select(Attempt)
        .where(Attempt.job_id == job.id, Attempt.number < attempt.number)
        .order_by(Attempt.number.desc())
    ).first()
    if (
        previous is not None
        and previous.status == AttemptStatus.FAILED
        and (previous.failure_code, previous.failure_message) == (failure.code, failure.message)
    ):
        return None
    where = f" on node {failure.node}" if failure.node else ""
    return f"restarting after {failure.code}{where} (restart {used + 1} of {allowed})"


def requeue(session: Session, job: Job, reason: str) -> None:
    """Put a placed job back to ``queued`` with ``reason`` (a restart or a preemption)."""
    transition(session, job, JobStatus.QUEUED, reason)
    job.requeue_reason = reason
    job.wait_reason = reason


def finish_cancellation(session: Session, job: Job) -> bool:
    """A cancelling job whose placements are all done becomes cancelled; True if it did."""
    if job.status != JobStatus.CANCELLING or open_placements(session, Placement.job_id == job.id):
        return False
    now = utcnow()
    for attempt in locked_live_attempts(session, job.id):
        end_attempt(attempt, AttemptStatus.CANCELLED, now)
    transition(session, job, JobStatus.CANCELLED, "every rank stopped")
    return True


def finish_preemption(session: Session, job: Job, attempt: Attempt) -> bool:
    """A live attempt being preempted whose placements are all done ends ``preempted``, and
    its job goes back to ``queued`` (reason ``preempted``, no restart counted); True if it did."""
    if attempt.status not in LIVE_ATTEMPT_STATUSES or attempt.preempt_requested_at is None:
        return False
    if _awaits_engine_ending(attempt):
        return False
    if open_placements(session, Placement.attempt_id == attempt.id):
        return False
    end_attempt(attempt, AttemptStatus.PREEMPTED, utcnow())
    attempt.failure_message = _preemption_message(attempt)
    if job.status in PLACED_STATUSES:
        requeue(session, job, "preempted")
        emit_job_event(session, job, "job.preempted")
        log.info("job %s: attempt %d preempted, back to the queue", job.id, attempt.number)
    return True


def _awaits_engine_ending(attempt: Attempt) -> bool:
    """An engine that says how its jobs ended (Slurm, Kubernetes: preempted, or cancelled
    from outside): until it has said it, a preempted attempt of it is not settled here."""
    return capabilities_of(attempt.engine).reports_ends and attempt.engine_state is None


def _preemption_message(attempt: Attempt) -> str:
    """Why a preempted attempt ended: the scheduler's reclaim, its engine's word, or its node's drain."""
    if attempt.preempt_reason:
        return f"preempted: {attempt.preempt_reason}"
    if capabilities_of(attempt.engine).reports_ends:
        return f"preempted: {attempt.engine} stopped its job ({attempt.engine_state})"
    return "preempted: a node of the attempt was drained"
