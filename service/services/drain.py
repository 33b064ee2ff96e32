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

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Node, Placement, utcnow
from service.services import refs
from service.services.attempts import preempt_node_attempts
from service.services.cluster import node_status
from service.services.transitions import set_node_status
from service.states import DRAINED_NODE_STATUSES, NodeStatus, PlacementStatus
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
