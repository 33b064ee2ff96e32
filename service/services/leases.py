"""Leases: every write from a worker carries its placement's lease token, and its node's
heartbeats (or its launcher's) renew it.

A token that is unknown, belongs to another worker, or whose placement is finished is
stale: the write is refused with 409 ``StaleLeaseError`` and changes nothing.

A lease past its expiry time is *not* refused by itself: its placement ends only when
the reaper says so (``WorkerLostError``), and the reaper first gives nodes a full lease
period after the API or its database comes back (see :mod:`service.services.upkeep`).
So an agent whose reports waited out an API restart is still heard.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Attempt, Job, Node, Placement
from service.db.types import utcnow
from service.services.tokens import Principal
from service.states import ABORTED_ATTEMPT_STATUSES, LIVE_ATTEMPT_STATUSES, JobStatus, PlacementStatus
from torchyard.contract.errors import StaleLeaseError
from torchyard.contract.headers import LEASE_HEADER
from torchyard.contract.protocol import LeaseRenewal, StopOrder


def speaks_for(principal: Principal) -> ColumnElement[bool]:
    """SQL condition on ``Placement``: a placement this worker token may speak for (its nodes'
    placements; a launch token's, its attempt's only)."""
    if principal.attempt_id is not None:
        return Placement.attempt_id == principal.attempt_id
    return Placement.node_id.in_(select(Node.id).where(Node.token_id == principal.id))


def placement_for_lease(
    session: Session, principal: Principal, lease_token: str | None, *, for_update: bool = False
) -> Placement:
    """The live placement holding ``lease_token`` for this worker, or StaleLeaseError."""
    if not lease_token:
        raise StaleLeaseError(f"missing {LEASE_HEADER} header")
    stmt = select(Placement).where(Placement.lease_token == lease_token, speaks_for(principal))
    if for_update:
        stmt = stmt.with_for_update(of=Placement)
    placement = session.scalars(stmt).first()
    if placement is None:
        raise StaleLeaseError("unknown lease token")
    _ensure_live(placement)
    return placement


def lock_lease(
    session: Session, principal: Principal, lease_token: str | None, *, job_id: str | None = None
) -> tuple[Job, Placement]:
    """The job and the live placement holding ``lease_token``, both row-locked (job first).

    Raises ``StaleLeaseError`` (409) for an unknown, finished, expired or other worker's
    lease, or, with ``job_id``, one that belongs to another job. Checked again once the
    locks are held, so a lease ended by a concurrent request is seen as stale.
    """
    found = placement_for_lease(session, principal, lease_token)
    if job_id is not None and found.job_id != job_id:
        raise StaleLeaseError("the lease belongs to another job")
    job = session.scalars(select(Job).where(Job.id == found.job_id).with_for_update()).one()
    placement = session.scalars(
        select(Placement)
        .where(Placement.id == found.id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).one()
    _ensure_live(placement)
    return job, placement


def _ensure_live(placement: Placement) -> None:
    if placement.status == PlacementStatus.DONE:
        raise StaleLeaseError("the lease's placement is finished")


def renew_leases(
    session: Session,
    settings: Settings,
    leases: list[str],
    *,
    owns: Callable[[Placement], bool],
    draining: bool = False,
) -> tuple[list[LeaseRenewal], list[StopOrder]]:
    """Renew the listed leases the caller ``owns`` (another's count as unknown) and say which
    placements must stop: finished, cancelling, preempted (``draining``: the node of a
    resident agent is drained), or of an attempt that ended. The caller commits."""
    now = utcnow()
    expires = now + timedelta(seconds=settings.lease_timeout_s)
    wanted = set(leases)
    rows = (
        session.execute(
            select(Placement, Attempt, Job.status)
            .join(Attempt, Attempt.id == Placement.attempt_id)
            .join(Job, Job.id == Placement.job_id)
            .where(Placement.lease_token.in_(wanted))
            .order_by(Placement.id)
            .with_for_update(of=Placement)
        ).all()
        if wanted
        else []
    )
    renewed: list[LeaseRenewal] = []
    stop: list[StopOrder] = []
    seen: set[str] = set()
    for placement, attempt, job_status in rows:
        if not owns(placement):
            continue  # another node's token: treated as unknown below
        seen.add(placement.lease_token)
        if placement.status != PlacementStatus.DONE:
            # A lease past its expiry but not ended by the reaper is renewed: it ran out while
            # nobody could hear the node (the API or its database was down), and only the
            # reaper, after its grace period, decides that a node is gone.
            placement.lease_expires_at = expires
            renewed.append(LeaseRenewal(lease_token=placement.lease_token, lease_expires_at=expires))
        order = _stop_order(placement, attempt, job_status, draining=draining, now=now)
        if order is not None:
            stop.append(order)
    for token in sorted(wanted - seen):
        stop.append(StopOrder(lease_token=token, reason="stale", message="unknown lease token"))
    return renewed, stop


def _stop_order(
    placement: Placement, attempt: Attempt, job_status: JobStatus, *, draining: bool, now: datetime
) -> StopOrder | None:
    """Why the ranks of a placement whose lease its node holds must stop, if they must: the
    placement is finished, the job cancelling, the attempt preempted (asked now when the
    node is ``draining``) or ended without success."""
    token, job_id = placement.lease_token, placement.job_id
    if placement.status == PlacementStatus.DONE:
        return StopOrder(
            lease_token=token, job_id=job_id, reason="stale", message="the placement is finished"
        )
    if job_status == JobStatus.CANCELLING:
        return StopOrder(
            lease_token=token, job_id=job_id, reason="cancelled", message="the job is being cancelled"
        )
    if attempt.status in LIVE_ATTEMPT_STATUSES and (attempt.preempt_requested_at is not None or draining):
        if attempt.preempt_requested_at is None:
            attempt.preempt_requested_at = now
        return StopOrder(
            lease_token=token,
            job_id=job_id,
            reason="preempted",
            message=f"attempt {attempt.number} is preempted (a node of it is draining): "
            "checkpoint at the next step boundary, upload it, then report preempted",
        )
    if attempt.status in ABORTED_ATTEMPT_STATUSES:
        return StopOrder(
            lease_token=token,
            job_id=job_id,
            reason="attempt_ended",
            message=f"attempt {attempt.number} {attempt.status}"
            + (f": {attempt.failure_message}" if attempt.failure_message else ""),
        )
    return None
