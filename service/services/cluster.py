"""Cluster limits: the one place where a job's shape is checked against the node registry."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Node
from service.states import NodeStatus
from torchyard.errors import ResourceLimitError


@dataclass(frozen=True)
class ClusterLimits:
    max_nodes: int
    max_units_per_node: int
    ready_nodes: int


def cluster_limits(session: Session, settings: Settings) -> ClusterLimits:
    ready, largest = session.execute(
        select(func.count(Node.id), func.coalesce(func.max(Node.units), 0)).where(
            Node.status == NodeStatus.READY.value
        )
    ).one()
    max_nodes = settings.max_nodes if settings.max_nodes is not None else int(ready)
    return ClusterLimits(max_nodes=max_nodes, max_units_per_node=int(largest), ready_nodes=int(ready))


def check_resources(
    session: Session, settings: Settings, node_count: int, process_count_per_node: int
) -> ClusterLimits:
    """Refuse a job shape the cluster can never run (SPEC §5), naming the field, value and limit."""
    limits = cluster_limits(session, settings)
    problems = []
    if node_count > limits.max_nodes:
        problems.append(
            {
                "field": "resources.node_count",
                "value": node_count,
                "limit": limits.max_nodes,
                "message": f"node_count {node_count} exceeds the cluster's {limits.max_nodes} "
                f"node{'s' if limits.max_nodes != 1 else ''}",
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
                if limits.ready_nodes
                else f"process_count_per_node {process_count_per_node} cannot be placed: "
                "the cluster has no ready nodes (start a worker)",
            }
        )
    if problems:
        raise ResourceLimitError("; ".join(p["message"] for p in problems), details=problems)
    return limits


def node_usage(session: Session) -> dict[str, tuple[int, list[str]]]:
    """Units held and attempt ids per node id, from placements not yet done."""
    from service.db.models import Placement

    usage: dict[str, tuple[int, list[str]]] = {}
    rows = session.execute(
        select(Placement.node_id, Placement.units, Placement.attempt_id).where(Placement.status != "done")
    ).all()
    for node_id, units, attempt_id in rows:
        held, attempts = usage.get(node_id, (0, []))
        usage[node_id] = (held + units, [*attempts, attempt_id])
    return usage
