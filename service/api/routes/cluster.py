from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import select

from service.api.deps import CurrentUser, ReadSessionDep, SettingsDep
from service.db.models import Node
from service.schemas.nodes import ClusterPublic, NodePublic
from service.services.cluster import cluster_limits, node_usage

router = APIRouter(prefix="/v1/cluster", tags=["cluster"])


@router.get("")
def get_cluster(session: ReadSessionDep, settings: SettingsDep, _user: CurrentUser) -> ClusterPublic:
    """Nodes with processing units, free units, accelerator and health; the cluster's limits."""
    limits = cluster_limits(session, settings)
    usage = node_usage(session)
    nodes = []
    for node in session.scalars(select(Node).order_by(Node.name)):
        held, attempts = usage.get(node.id, (0, []))
        nodes.append(
            NodePublic(
                name=node.name,
                address=node.address,
                units=node.units,
                free_units=max(0, node.units - held),
                accelerator=node.accelerator,
                status=node.status,
                last_heartbeat_at=node.last_heartbeat_at,
                registered_at=node.registered_at,
                running_attempts=attempts,
            )
        )
    return ClusterPublic(
        max_nodes=limits.max_nodes,
        max_units_per_node=limits.max_units_per_node,
        ready_nodes=limits.ready_nodes,
        nodes=nodes,
    )
