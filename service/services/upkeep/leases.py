"""Expired leases: a placement whose lease ran out is done, and its live attempt fails with
``WorkerLostError`` naming its node (the job restarts or fails)."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.engine import Database
from service.db.models import Node, Placement
from service.services.lost_placements import lose_placements
from service.services.upkeep.nodes import kept_by_heartbeats
from service.states import NodeStatus, PlacementStatus

# Placements whose lease ran out, by job: their ids, and the failure message of each.
Expired = dict[str, tuple[list[str], dict[str, str]]]


def expired_by_job(session: Session, settings: Settings, now: datetime) -> Expired:
    """Placements whose lease ran out, by job, with the failure message naming each node
    (less those judged with their node: :func:`_judged_with_its_node`)."""
    rows = session.execute(
        select(Placement.job_id, Placement.id, Placement.status, Placement.lease_expires_at, Node)
        .join(Node, Node.id == Placement.node_id)
        .where(Placement.status != PlacementStatus.DONE, Placement.lease_expires_at < now)
    ).all()
    by_job: Expired = {}
    for job_id, placement_id, status, expires, node in rows:
        if _judged_with_its_node(settings, status, expires, node):
            continue
        node_name = node.name
        ids, messages = by_job.setdefault(job_id, ([], {}))
        ids.append(placement_id)
        messages[placement_id] = (
            f"node {node_name} did not claim its placement within {settings.lease_timeout_s:g} s"
            if status == PlacementStatus.ASSIGNED
            else f"node {node_name} stopped heartbeating"
        )
    return by_job


def lose_expired_leases(db: Database, expired: Expired) -> int:
    """Lose the placements of each job (in a transaction of its own); how many were lost here
    (another replica may have handled some)."""
    lost = 0
    for job_id, (placement_ids, messages) in expired.items():
        with db.transaction() as session:
            if lose_placements(session, job_id, placement_ids, messages):
                lost += len(placement_ids)
    return lost


def _judged_with_its_node(settings: Settings, status: PlacementStatus, expires: datetime, node: Node) -> bool:
    """Whether a claimed placement's expired lease waits for its node to be judged.

    The node's last heartbeat came within one heartbeat interval of the lease's last
    renewal: it can be one the agent sent before it claimed the placement (heartbeats and
    claims travel side by side), so it says nothing of the agent having let the lease go.
    Such a node is going silent with its lease, and is lost with it at most one interval
    later; losing the lease first would put the job back to a node that is about to be
    lost, and spend a second restart there."""
    if status != PlacementStatus.RUNNING or not kept_by_heartbeats(node):
        return False
    if node.status != NodeStatus.READY:
        return False
    renewed = expires - timedelta(seconds=settings.lease_timeout_s)
    return node.last_heartbeat_at < renewed + timedelta(seconds=settings.heartbeat_interval_s)
