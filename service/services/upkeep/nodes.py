"""Silent nodes: a ready node whose agent has not heartbeated for ``lease_timeout_s`` is
``lost``, and its placements are lost with it (their jobs restart or fail)."""

from __future__ import annotations

import logging
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.engine import Database
from service.db.models import Node
from service.engines import CAPABILITIES, capabilities_of
from service.services.lost_placements import lose_node_placements
from service.services.scheduler import is_postgres
from service.services.transitions import set_node_status
from service.states import NodeStatus

log = logging.getLogger(__name__)
# The engines whose nodes heartbeat themselves (their silence means the node is lost).
HEARTBEAT_ENGINES = sorted(name for name, can in CAPABILITIES.items() if can.nodes_heartbeat)


def kept_by_heartbeats(node: Node) -> bool:
    """The node's own agent keeps its row alive with heartbeats (the built-in agents), so its
    silence means something; an engine's nodes are kept by its inventory instead."""
    return capabilities_of(node.engine).nodes_heartbeat


def silent_nodes(session: Session, cutoff: datetime) -> list[str]:
    """The ids of the ready nodes kept by heartbeats (:func:`kept_by_heartbeats`) that have
    not heartbeated since ``cutoff``."""
    return list(
        session.scalars(
            select(Node.id).where(
                Node.engine.in_(HEARTBEAT_ENGINES),
                Node.status == NodeStatus.READY,
                Node.last_heartbeat_at < cutoff,
            )
        )
    )


def lose_silent_nodes(
    db: Database, settings: Settings, node_ids: list[str], cutoff: datetime, known: dict[str, str]
) -> list[str]:
    """Mark each node still silent since ``cutoff`` lost, then lose its placements; the names
    of the nodes lost. ``known``: the failure message of a placement already lost for a
    reason of its own (its lease ran out first), kept even when its node falls silent in the
    same pass (a replica that paused past both deadlines must not blur them)."""
    lost: list[str] = []
    for node_id in node_ids:
        with db.transaction() as session:
            name = _mark_lost(session, node_id, cutoff)
        if name is None:
            continue
        lost.append(name)
        log.warning("node %s is lost: no heartbeat for %.1f s", name, settings.lease_timeout_s)
        lose_node_placements(db, node_id, f"node {name} stopped heartbeating", known)
    return lost


def _mark_lost(session: Session, node_id: str, cutoff: datetime) -> str | None:
    stmt = select(Node).where(
        Node.id == node_id, Node.status == NodeStatus.READY, Node.last_heartbeat_at < cutoff
    )
    if is_postgres(session):
        stmt = stmt.with_for_update(skip_locked=True)
    node = session.scalars(stmt).first()
    if node is None:
        return None
    set_node_status(node, NodeStatus.LOST)
    return node.name
