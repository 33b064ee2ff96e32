"""The node registry: agents register their node and keep it alive with heartbeats.

A node name belongs to the worker token that first registered it: another token gets
409 ``NodeNameInUseError`` and changes nothing, unless the owner token was revoked.
Within that token, the node is held by one agent at a time, known by the per-node key
it sends (at registration, then in the ``X-Torchyard-Agent-Key`` header). An agent with
another key is refused while the holder's heartbeats are fresh; once the node has been
silent for the lease timeout, a new agent may take it over, and the old one, should it
speak again, is told to stop.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Node, Token
from service.db.types import utcnow
from service.services.leases import renew_leases
from service.services.tokens import Principal
from service.services.transitions import set_node_status
from service.states import NodeStatus
from torchyard.contract.errors import NodeNameInUseError, NotFoundError
from torchyard.contract.protocol import HeartbeatResponse


def hash_agent_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _key_matches(node: Node, key: str | None) -> bool:
    if node.agent_key_hash is None:
        return True  # registered without a key: nothing to compare
    return key is not None and hmac.compare_digest(node.agent_key_hash, hash_agent_key(key))


def is_fresh(node: Node, now: datetime, lease_timeout_s: float) -> bool:
    """The node's agent heartbeated within the lease timeout (and the node is not lost)."""
    return node.status != NodeStatus.LOST and now - node.last_heartbeat_at < timedelta(
        seconds=lease_timeout_s
    )


def _holder(node: Node, now: datetime) -> str:
    info = node.info or {}
    where = ", ".join(
        f"{label} {info[key]}"
        for key, label in (("hostname", "host"), ("pid", "pid"))
        if info.get(key) is not None
    )
    silent = (now - node.last_heartbeat_at).total_seconds()
    return f"{where + ', ' if where else ''}last heartbeat {silent:.1f} s ago"


def register_node(
    session: Session,
    principal: Principal,
    *,
    name: str,
    address: str,
    units: int,
    accelerator: str,
    info: dict[str, Any] | None = None,
    agent_key: str | None = None,
    lease_timeout_s: float,
) -> Node:
    """Create or take the node ``name`` for this agent. The caller commits.

    Refused with ``NodeNameInUseError`` (nothing changed) when another worker token owns
    the name, or another agent of this token holds it and is alive.
    """
    now = utcnow()
    node = session.scalars(select(Node).where(Node.name == name).with_for_update()).first()
    if node is None:
        node = Node(name=name, token_id=principal.id, registered_at=now)
        session.add(node)
    elif node.token_id != principal.id:
        owner = session.get(Token, node.token_id)
        if owner is not None and owner.revoked_at is None:
            raise NodeNameInUseError(
                f"node name {name!r} is registered by another worker token; start this agent with "
                "another --name, or revoke that token to free the name"
            )
        node.token_id = principal.id  # the owner's token was revoked: the name is free
    elif not _key_matches(node, agent_key) and is_fresh(node, now, lease_timeout_s):
        raise NodeNameInUseError(
            f"another agent holds node name {name!r} ({_holder(node, now)}); stop that agent, or start "
            f"this one with another --name (a node silent for {lease_timeout_s:g} s may be taken over)"
        )
    node.agent_key_hash = hash_agent_key(agent_key) if agent_key is not None else None
    node.address = address
    node.units = units
    node.accelerator = accelerator
    node.info = info
    if node.drained_by != "admin":
        # A node drained by its own agent (SIGTERM) is ready again once an agent registers it;
        # an admin's drain holds until undrained.
        set_node_status(node, NodeStatus.READY)
        node.drained_by = None
    elif node.status == NodeStatus.LOST:
        set_node_status(node, NodeStatus.DRAINED)
    node.last_heartbeat_at = now
    session.flush()
    return node


def get_own_node(session: Session, principal: Principal, name: str, *, for_update: bool = False) -> Node:
    stmt = select(Node).where(Node.name == name)
    if for_update:
        stmt = stmt.with_for_update()
    return own_node(session.scalars(stmt).first(), principal, name)


def own_node(node: Node | None, principal: Principal, name: str) -> Node:
    """``node`` (the row named ``name``, or None), if ``principal``'s token registered it."""
    if node is None or node.token_id != principal.id:
        raise NotFoundError(f"node {name!r} is not registered by this worker token")
    return node


def check_agent(
    session: Session, principal: Principal, name: str, agent_key: str | None, *, for_update: bool = False
) -> Node:
    """The node, if the calling agent is the one holding it; 409 ``NodeNameInUseError`` when
    another agent registered it since (this one must stop). ``for_update``: its row locked."""
    return held_by_agent(get_own_node(session, principal, name, for_update=for_update), agent_key)


def held_by_agent(node: Node, agent_key: str | None) -> Node:
    """``node``, if the agent sending ``agent_key`` holds it (else 409, as :func:`check_agent`)."""
    if not _key_matches(node, agent_key):
        raise NodeNameInUseError(
            f"node {node.name!r} is now held by another agent ({_holder(node, utcnow())}); this agent must stop"
        )
    return node


def touch_node(session: Session, node: Node) -> bool:
    """Record a heartbeat; a lost node that speaks again is ready again (a drained one stays
    drained). True when it came back (capacity the scheduler can place onto again)."""
    node.last_heartbeat_at = utcnow()
    if node.status == NodeStatus.LOST:
        set_node_status(node, NodeStatus.READY)
        return True
    return False


def heartbeat(session: Session, settings: Settings, node: Node, leases: list[str]) -> HeartbeatResponse:
    """Renew ``node`` (its row read, checked and locked by the caller) and the leases it
    lists; say which placements must stop. The caller commits."""
    touch_node(session, node)
    renewed, stop = renew_leases(
        session,
        settings,
        leases,
        owns=lambda placement: placement.node_id == node.id,
        draining=node.status != NodeStatus.READY,
    )
    return HeartbeatResponse(
        node=node.name,
        status=node.status,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        lease_timeout_s=settings.lease_timeout_s,
        claim_poll_timeout_s=settings.claim_poll_timeout_s,
        renewed=renewed,
        stop=stop,
    )
