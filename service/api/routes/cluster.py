from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import (
    AdminUser,
    CurrentUser,
    DatabaseDep,
    ReadSessionDep,
    SchedulingDep,
    SessionDep,
    SettingsDep,
)
from service.api.routing import SessionScopedRoute
from service.services import agents
from service.services.cluster import cluster_view
from torchyard.contract.responses import ClusterPublic, NodeDrained

router = APIRouter(prefix="/v1/cluster", tags=["cluster"], route_class=SessionScopedRoute)


@router.get("")
def get_cluster(session: ReadSessionDep, settings: SettingsDep, user: CurrentUser) -> ClusterPublic:
    """Nodes with processing units, free units, accelerator, health and the attempts they run;
    the cluster's limits (max nodes, units of the largest node) that submissions are checked against."""
    return cluster_view(session, settings, user)


@router.post("/nodes/{node}/drain")
def drain_node(
    node: str,
    session: SessionDep,
    db: DatabaseDep,
    settings: SettingsDep,
    scheduling: SchedulingDep,
    admin: AdminUser,
) -> NodeDrained:
    """Admin only: the node (id or name) takes no new work, and the jobs running there checkpoint
    at the next step boundary and go back to ``queued`` (reason ``preempted``, no restart counted).
    ``draining`` while its placements stop, then ``drained``; held until ``undrain``."""
    answer = agents.drain_by_admin(session, db, settings, node)
    scheduling.request()
    return answer


@router.post("/nodes/{node}/undrain")
def undrain_node(
    node: str,
    session: SessionDep,
    db: DatabaseDep,
    settings: SettingsDep,
    scheduling: SchedulingDep,
    admin: AdminUser,
) -> NodeDrained:
    """Admin only: a drained node (id or name) is ready for new work again."""
    answer = agents.undrain_by_admin(session, db, settings, node)
    scheduling.request()
    return answer
