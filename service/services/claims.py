"""Claims: a node's agent takes the placements a scheduling pass assigned to it.

A claim hands the node its oldest ``assigned`` placement of a live attempt, marks it
``running`` (claimed) and renews its lease. Scheduling happens elsewhere
(:mod:`service.services.scheduler_loop`); a claim reads the node's own rows only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Attempt, Job, Placement
from service.db.types import utcnow
from service.services.kinds import kind_of
from service.services.kinds.base import Claim
from service.services.nodes import get_own_node, touch_node
from service.services.scheduler import is_postgres
from service.services.tokens import Principal
from service.services.transitions import set_placement_status
from service.states import LIVE_ATTEMPT_STATUSES, PLACED_STATUSES, NodeStatus, PlacementStatus
from torchyard.contract.protocol import ClaimedPlacement

log = logging.getLogger(__name__)


def claimed_placement(session: Session, placement: Placement, settings: Settings) -> ClaimedPlacement:
    """What the node that claimed ``placement`` needs to launch it (its kind's payload)."""
    job = session.get_one(Job, placement.job_id)
    attempt = session.get_one(Attempt, placement.attempt_id)
    common: dict[str, Any] = {
        "job_id": job.id,
        "job_name": job.name,
        "attempt_id": attempt.id,
        "attempt_number": attempt.number,
        "lease_token": placement.lease_token,
        "lease_expires_at": placement.lease_expires_at,
        "node_rank": placement.node_rank,
        "node_count": job.node_count,
        "process_count_per_node": job.process_count_per_node,
        "world_size": job.node_count * job.process_count_per_node,
        "master_addr": attempt.master_addr,
        "master_port": attempt.master_port,
        "restarts": job.restarts or 0,
        "heartbeat_interval_s": settings.heartbeat_interval_s,
        "lease_timeout_s": settings.lease_timeout_s,
    }
    return kind_of(job).claimed(session, job, Claim(attempt, placement, common, settings))


@dataclass
class ClaimCheck:
    """What one claim check found: the placement handed over (or None), the node's id, and
    whether the check brought a lost node back (capacity for a scheduling pass)."""

    placement: ClaimedPlacement | None
    node_id: str
    revived: bool = False


def claim(
    session: Session,
    settings: Settings,
    principal: Principal,
    node_name: str,
    *,
    fresh: bool = True,
) -> ClaimCheck:
    """Hand the node its next assigned placement, if a scheduling pass put one there.

    ``fresh``: the agent has just asked (a sign of life: the node is touched, and a lost
    node is ready again). A re-check of a long-poll the API holds (``fresh=False``) says
    nothing of the agent, which may have died or frozen since it asked: it neither touches
    the node nor revives a lost one (nor hands a lost node work). The caller commits.
    """
    node = get_own_node(session, principal, node_name)
    revived = False
    if fresh:
        revived = touch_node(session, node)
    elif node.status == NodeStatus.LOST:
        return ClaimCheck(None, node.id)
    stmt = (
        select(Placement)
        .join(Job, Job.id == Placement.job_id)
        .join(Attempt, Attempt.id == Placement.attempt_id)
        .where(
            Placement.node_id == node.id,
            Placement.status == PlacementStatus.ASSIGNED,
            Job.status.in_(PLACED_STATUSES),
            Attempt.status.in_(LIVE_ATTEMPT_STATUSES),
            Attempt.preempt_requested_at.is_(None),
        )
        .order_by(Placement.created_at, Placement.id)
        .limit(1)
    )
    if is_postgres(session):
        stmt = stmt.with_for_update(skip_locked=True, of=Placement)
    placement = session.scalars(stmt).first()
    if placement is None:
        return ClaimCheck(None, node.id, revived)
    now = utcnow()
    set_placement_status(placement, PlacementStatus.RUNNING, now)
    placement.lease_expires_at = now + timedelta(seconds=settings.lease_timeout_s)
    log.info("node %s claimed job %s (node rank %d)", node.name, placement.job_id, placement.node_rank)
    return ClaimCheck(claimed_placement(session, placement, settings), node.id, revived)


def work_pending(session: Session, node_id: str) -> bool:
    """Read-only: whether the node has an assigned placement (its own rows only)."""
    assigned = session.scalars(
        select(Placement.id)
        .where(Placement.node_id == node_id, Placement.status == PlacementStatus.ASSIGNED)
        .limit(1)
    ).first()
    return assigned is not None
