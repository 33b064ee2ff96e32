"""Lease fencing: every write from a worker carries its placement's lease token.

A token that is unknown, belongs to another worker, or whose placement is finished is
stale: the write is refused with 409 ``StaleLeaseError`` and changes nothing.

A lease past its expiry time is *not* refused by itself: its placement ends only when
the reaper says so (``WorkerLostError``), and the reaper first gives nodes a full lease
period after the API or its database comes back (see :mod:`service.services.reaper`).
So an agent whose reports waited out an API restart is still heard.
"""

from __future__ import annotations

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import Session

from service.db.models import Job, Node, Placement
from service.services.tokens import Principal
from service.states import PlacementStatus
from torchyard.contract.errors import StaleLeaseError
from torchyard.contract.headers import LEASE_HEADER


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
