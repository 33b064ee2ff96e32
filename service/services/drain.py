"""Draining nodes (docs/restarts.md): an admin's ``drain``, or an agent's own when it gets SIGTERM.

A drained node takes no new placements (the scheduler places on ``ready`` nodes only).
Every live attempt with a placement on it is asked to checkpoint at the next step boundary
and stop: its nodes get a ``preempted`` stop order at their next heartbeat, report
``preempted``, and once every placement is done the job goes back to ``queued`` with
reason ``preempted``, not counted in ``restarts``. The node shows ``draining`` while it
still has placements, then ``drained``. ``undrain`` makes it ready again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Attempt, Node, Placement
from service.db.types import utcnow
from service.services import refs
from service.services.attempt_outcomes import finish_cancellation, finish_preemption, locked_job
from service.services.cluster import node_status
from service.services.transitions import set_node_status, set_placement_status
from service.states import DRAINED_NODE_STATUSES, LIVE_ATTEMPT_STATUSES, NodeStatus, PlacementStatus
from torchyard.contract.errors import NotFoundError

log = logging.getLogger(__name__)


@dataclass
class DrainResult:
    name: str
    status: str
    drained_by: str | None
    preempted_jobs: list[str] = field(default_factory=list)


def find_node(session: Session, ref: str, *, for_update: bool = False) -> Node:
    """A node by id or name."""
    if not refs.comparable(ref):
        raise NotFoundError(f"node {ref!r} not found (no node has this id or name)")
    stmt = select(Node).where(or_(Node.id == ref, Node.name == ref))
    if for_update:
        stmt = stmt.with_for_update()
    node = session.scalars(stmt).first()
    if node is None:
        raise NotFoundError(f"node {ref!r} not found (no node has this id or name)")
    return node


def _result(session: Session, settings: Settings, node: Node, jobs: list[str]) -> DrainResult:
    busy = session.scalars(
        select(Placement.id)
        .where(Placement.node_id == node.id, Placement.status != PlacementStatus.DONE)
        .limit(1)
    ).first()
    status = node_status(node, settings, utcnow(), busy=busy is not None)
    return DrainResult(node.name, status, node.drained_by, jobs)


def drain(session: Session, settings: Settings, node: Node, by: str) -> DrainResult:
    """Drain ``node`` (``by``: "admin" or "agent") and preempt what runs there. The caller commits."""
    node_id = node.id
    if node.status not in DRAINED_NODE_STATUSES:
        set_node_status(node, NodeStatus.DRAINING)
        log.warning("node %s is draining (by %s)", node.name, by)
    if by == "admin" or node.drained_by is None:
        node.drained_by = by
    session.flush()
    jobs = preempt_node_attempts(session, node)
    return _result(session, settings, session.get_one(Node, node_id), jobs)


def undrain(session: Session, settings: Settings, node: Node) -> DrainResult:
    """Make a drained node ready again (a no-op for a node that is not drained). The caller commits."""
    if node.status in DRAINED_NODE_STATUSES:
        set_node_status(node, NodeStatus.READY)
        node.drained_by = None
        log.info("node %s is ready again (undrained)", node.name)
    session.flush()
    return _result(session, settings, node, [])


def preempt_node_attempts(session: Session, node: Node) -> list[str]:
    """Ask every live attempt with a placement on ``node`` to checkpoint and stop.

    Placements not yet claimed have no process: they are done at once, and an attempt with
    nothing left running is preempted here. Returns the ids of the jobs touched. The caller
    holds no job lock yet (jobs are locked here, one by one, before their placements).
    """
    job_ids = list(
        session.scalars(
            select(Placement.job_id)
            .where(Placement.node_id == node.id, Placement.status != PlacementStatus.DONE)
            .distinct()
            .order_by(Placement.job_id)
        )
    )
    now = utcnow()
    for job_id in job_ids:
        preempt_job(session, job_id, now)
    return job_ids


def preempt_job(session: Session, job_id: str, now: datetime, reason: str | None = None) -> None:
    """Ask the job's live attempts to checkpoint and stop (``reason``: why, for its history;
    none: a drained node). Placements not yet claimed are done at once; an attempt with
    nothing left running is preempted here. Locks the job, then its attempts."""
    job = locked_job(session, job_id)
    for attempt in session.scalars(
        select(Attempt)
        .where(Attempt.job_id == job_id, Attempt.status.in_(LIVE_ATTEMPT_STATUSES))
        .with_for_update()
        .execution_options(populate_existing=True)
    ).all():
        if attempt.preempt_requested_at is None:
            attempt.preempt_requested_at = now
            attempt.preempt_reason = reason
        for placement in session.scalars(
            select(Placement)
            .where(Placement.attempt_id == attempt.id, Placement.status == PlacementStatus.ASSIGNED)
            .order_by(Placement.id)
            .with_for_update()
        ):
            set_placement_status(placement, PlacementStatus.DONE, now)
        finish_preemption(session, job, attempt)
    finish_cancellation(session, job)
