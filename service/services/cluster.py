"""The cluster as users see it, and its limits: the one place where a job's shape is checked
against the node registry.

A node is *ready* while its status is ``ready`` and it was heard from within the lease
timeout; otherwise it is *lost* — also before the reaper has got round to marking it,
so the limits, the cluster view and the scheduler agree on which nodes count.

Limits (docs/api.md) are checked at submission only. When the cluster later shrinks so
that a queued job can no longer fit (it needs more nodes than are ready, or more
processes per node than any ready node has units), the job is *not* failed: nodes
come back (a restarted agent, a rebooted machine), so it keeps waiting in the queue
and its reason says what it needs and what the cluster has now. The scheduler writes
that reason (see ``service.services.scheduler``) and does not let such a job hold up
the jobs behind it. A user who does not want to wait cancels it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import BindParameter, and_, bindparam, case, func, or_, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Attempt, Job, Node, Placement
from service.db.types import utcnow
from service.engines import capabilities_of
from service.services.job_lookup import may_read
from service.services.tokens import Principal
from service.states import DRAINED_NODE_STATUSES, NodeStatus, PlacementStatus
from torchyard.contract.errors import ResourceLimitError
from torchyard.contract.responses import ClusterPublic, NodeAttemptPublic, NodePublic

# A ready node: status ready and a heartbeat within the lease timeout. The hot statements
# (every submission, every scheduling pass) are built once, with the condition's values as
# parameters (:func:`_ready_params`): SQLAlchemy then neither builds them nor works out their
# cache key again on each execution.
_ENGINE: BindParameter[str] = bindparam("engine")
_READY = and_(
    Node.engine == _ENGINE,
    Node.status == NodeStatus.READY,
    Node.last_heartbeat_at >= bindparam("fresh_after"),
)
_READY_LIMITS = select(func.count(Node.id), func.coalesce(func.max(Node.units), 0)).where(_READY)
_SUBMISSION_LIMITS = select(
    func.coalesce(func.sum(case((_READY, 1), else_=0)), 0),
    func.coalesce(func.max(case((_READY, Node.units))), 0),
    func.count(Node.id),
    func.coalesce(func.max(Node.units), 0),
).where(or_(_READY, and_(Node.engine == _ENGINE, Node.last_heartbeat_at >= bindparam("seen_after"))))
_HELD = (
    select(Placement.node_id, func.sum(Placement.units).label("units"))
    .where(Placement.status != PlacementStatus.DONE)
    .group_by(Placement.node_id)
    .subquery()
)
_READY_CAPACITY = (
    select(Node.id, Node.name, Node.address, Node.units, _HELD.c.units, Node.accelerator)
    .outerjoin(_HELD, _HELD.c.node_id == Node.id)
    .where(_READY)
    .order_by(Node.name)
)


def _ready_params(settings: Settings, now: datetime) -> dict[str, Any]:
    return {"engine": settings.engine, "fresh_after": _fresh_after(settings.engine, settings, now)}


def _fresh_after(engine: str, settings: Settings, now: datetime) -> datetime:
    """Heard from since when, for a ready node: within the lease timeout where nodes heartbeat
    themselves; for an engine whose inventory says which nodes are ready, any time."""
    if capabilities_of(engine).nodes_heartbeat:
        return now - timedelta(seconds=settings.lease_timeout_s)
    return datetime.min.replace(tzinfo=now.tzinfo)


def node_status(node: Node, settings: Settings, now: datetime, *, busy: bool = False) -> NodeStatus:
    """``ready`` or ``lost``, counting a node silent past the lease timeout as lost; a drained
    node is ``draining`` while it still has placements (``busy``), then ``drained``."""
    if node.status in DRAINED_NODE_STATUSES:
        return NodeStatus.DRAINING if busy else NodeStatus.DRAINED
    if node.status != NodeStatus.READY:
        return NodeStatus.LOST
    if node.last_heartbeat_at < _fresh_after(node.engine, settings, now):
        return NodeStatus.LOST
    return NodeStatus.READY


@dataclass(frozen=True)
class ClusterLimits:
    max_nodes: int
    max_units_per_node: int
    ready_nodes: int
    # "setting" when TORCHYARD_MAX_NODES fixes max_nodes, "ready_nodes" when it follows the registry.
    max_nodes_source: str


def cluster_limits(session: Session, settings: Settings, now: datetime | None = None) -> ClusterLimits:
    """Max nodes (the setting, else the ready nodes) and the units of the largest ready node."""
    now = now or utcnow()
    ready, largest = session.execute(_READY_LIMITS, _ready_params(settings, now)).one()
    if settings.max_nodes is not None:
        return ClusterLimits(settings.max_nodes, int(largest), int(ready), "setting")
    return ClusterLimits(int(ready), int(largest), int(ready), "ready_nodes")


def submission_limits(session: Session, settings: Settings, now: datetime | None = None) -> ClusterLimits:
    """The limits a submission is checked against: the ready nodes and every node heard from
    within ``node_memory_s`` (docs/restarts.md). While every worker restarts (an agent upgrade), the
    cluster it had a moment ago still counts: a job that fits it is accepted and waits.

    One query reads both: the nodes ready or seen, and among them the ready ones."""
    now = now or utcnow()
    if settings.node_memory_s <= 0:
        return cluster_limits(session, settings, now)
    params = _ready_params(settings, now) | {"seen_after": now - timedelta(seconds=settings.node_memory_s)}
    ready, ready_largest, seen, largest = session.execute(_SUBMISSION_LIMITS, params).one()
    ready, seen = int(ready), int(seen)
    # Every ready node is among those seen: their largest is the larger of both.
    largest = max(int(largest), int(ready_largest))
    if settings.max_nodes is not None:
        return ClusterLimits(settings.max_nodes, largest, ready, "setting")
    return ClusterLimits(max(seen, ready), largest, ready, "seen_nodes")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def check_resources(
    session: Session, settings: Settings, node_count: int, process_count_per_node: int
) -> ClusterLimits:
    """Refuse a job shape the cluster can never run (docs/api.md, §8), naming the field, value and
    limit: more nodes, or more processes per node, than the cluster has had within
    ``node_memory_s``."""
    limits = submission_limits(session, settings)
    problems: list[dict[str, Any]] = []
    if node_count > limits.max_nodes:
        because = {
            "setting": "TORCHYARD_MAX_NODES",
            "seen_nodes": f"the nodes seen in the last {settings.node_memory_s:g} s",
        }.get(limits.max_nodes_source, "the nodes ready now")
        problems.append(
            {
                "field": "resources.node_count",
                "value": node_count,
                "limit": limits.max_nodes,
                "message": f"node_count {node_count} exceeds the cluster's "
                f"{_plural(limits.max_nodes, 'node')} ({because})",
            }
        )
    if process_count_per_node > limits.max_units_per_node:
        problems.append(
            {
                "field": "resources.process_count_per_node",
                "value": process_count_per_node,
                "limit": limits.max_units_per_node,
                "message": f"process_count_per_node {process_count_per_node} exceeds the "
                f"{limits.max_units_per_node} processing units of the largest node"
                if limits.max_units_per_node
                else f"process_count_per_node {process_count_per_node} cannot be placed: "
                "the cluster has no ready nodes (start a worker)",
            }
        )
    if problems:
        raise ResourceLimitError("; ".join(p["message"] for p in problems), details=problems)
    return limits


@dataclass
class NodeShare:
    """A node's share of one attempt that is not done yet."""

    node_id: str
    job_id: str
    job_owner_id: str
    job_team_id: str | None
    attempt_id: str
    attempt_number: int
    node_rank: int
    units: int
    status: PlacementStatus


@dataclass
class NodeCapacity:
    id: str
    name: str
    address: str
    units: int
    free: int
    accelerator: str = "cpu"


def ready_capacity(session: Session, settings: Settings, now: datetime) -> list[NodeCapacity]:
    """Ready nodes (``_READY``) with their free units, by name: what the scheduler
    places onto. One query: each node's units held by its placements that are not done."""
    return [
        NodeCapacity(
            id=id_,
            name=name,
            address=address,
            units=units,
            free=max(0, units - int(used or 0)),
            accelerator=acc,
        )
        for id_, name, address, units, used, acc in session.execute(
            _READY_CAPACITY, _ready_params(settings, now)
        )
    ]


def node_usage(session: Session) -> dict[str, list[NodeShare]]:
    """Per node id, the placements not yet done (they hold the node's units)."""
    usage: dict[str, list[NodeShare]] = {}
    rows = session.execute(
        select(Placement, Attempt.number, Job.owner_id, Job.team_id)
        .join(Attempt, Attempt.id == Placement.attempt_id)
        .join(Job, Job.id == Placement.job_id)
        .where(Placement.status != PlacementStatus.DONE)
        .order_by(Placement.created_at, Placement.id)
    ).all()
    for placement, number, owner_id, team_id in rows:
        usage.setdefault(placement.node_id, []).append(
            NodeShare(
                node_id=placement.node_id,
                job_id=placement.job_id,
                job_owner_id=owner_id,
                job_team_id=team_id,
                attempt_id=placement.attempt_id,
                attempt_number=number,
                node_rank=placement.node_rank,
                units=placement.units,
                status=placement.status,
            )
        )
    return usage


def cluster_view(session: Session, settings: Settings, principal: Principal) -> ClusterPublic:
    """Every registered node with its health and load, and the limits submissions are checked against.

    Jobs a user may not read (docs/teams.md: neither their own nor their teams') show as
    held units and attempt ids without their job id.
    """
    now = utcnow()
    limits = cluster_limits(session, settings, now)
    usage = node_usage(session)
    nodes: list[NodePublic] = []
    for node in session.scalars(select(Node).where(Node.engine == settings.engine).order_by(Node.name)):
        shares = usage.get(node.id, [])
        # An engine's inventory may count what others' work holds there too (Kubernetes: what
        # every non-terminated pod requests), torchyard's own among it.
        held = max(sum(s.units for s in shares), int((node.info or {}).get("requested_units") or 0))
        status = node_status(node, settings, now, busy=bool(shares))
        nodes.append(
            NodePublic(
                name=node.name,
                address=node.address,
                units=node.units,
                used_units=held,
                free_units=max(0, node.units - held) if status is NodeStatus.READY else 0,
                accelerator=node.accelerator,
                status=status,
                last_heartbeat_at=node.last_heartbeat_at,
                seconds_since_heartbeat=round(max(0.0, (now - node.last_heartbeat_at).total_seconds()), 3),
                registered_at=node.registered_at,
                sandbox=_sandbox(node),
                engine=node.engine,
                engine_state=None
                if capabilities_of(node.engine).nodes_heartbeat
                else (node.info or {}).get("state"),
                running_attempts=[s.attempt_id for s in shares],
                attempts=[
                    NodeAttemptPublic(
                        attempt_id=s.attempt_id,
                        attempt_number=s.attempt_number,
                        job_id=s.job_id if may_read(principal, s.job_owner_id, s.job_team_id) else None,
                        node_rank=s.node_rank,
                        units=s.units,
                        status=s.status,
                    )
                    for s in shares
                ],
            )
        )
    ready = [n for n in nodes if n.status == NodeStatus.READY]
    return ClusterPublic(
        engine=settings.engine,
        max_nodes=limits.max_nodes,
        max_nodes_source=limits.max_nodes_source,
        max_units_per_node=limits.max_units_per_node,
        ready_nodes=limits.ready_nodes,
        lost_nodes=sum(1 for n in nodes if n.status == NodeStatus.LOST),
        total_units=sum(n.units for n in ready),
        free_units=sum(n.free_units for n in ready),
        nodes=nodes,
    )


def _sandbox(node: Node) -> str | None:
    value = (node.info or {}).get("sandbox")
    return value if value in ("bwrap", "off", "unavailable") else None
