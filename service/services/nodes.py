"""The node registry: agents register their node and keep it alive with heartbeats."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import Node, utcnow
from service.services.tokens import Principal
from service.states import NodeStatus
from torchyard.errors import ConflictError, NotFoundError


def register_node(
    session: Session,
    principal: Principal,
    *,
    name: str,
    address: str,
    units: int,
    accelerator: str,
    info: dict[str, Any] | None = None,
) -> Node:
    """Create or refresh the node ``name``; a node belongs to the worker token that made it."""
    now = utcnow()
    node = session.scalars(select(Node).where(Node.name == name).with_for_update()).first()
    if node is None:
        node = Node(name=name, token_id=principal.id, registered_at=now)
        session.add(node)
    elif node.token_id != principal.id:
        raise ConflictError(f"node name {name!r} is registered by another worker token")
    node.address = address
    node.units = units
    node.accelerator = accelerator
    node.info = info
    node.status = NodeStatus.READY.value
    node.last_heartbeat_at = now
    session.flush()
    return node


def get_own_node(session: Session, principal: Principal, name: str, *, for_update: bool = False) -> Node:
    stmt = select(Node).where(Node.name == name)
    if for_update:
        stmt = stmt.with_for_update()
    node = session.scalars(stmt).first()
    if node is None or node.token_id != principal.id:
        raise NotFoundError(f"node {name!r} is not registered by this worker token")
    return node


def touch_node(session: Session, node: Node) -> None:
    """Record a heartbeat; a lost node that speaks again is ready again."""
    node.last_heartbeat_at = utcnow()
    node.status = NodeStatus.READY.value
