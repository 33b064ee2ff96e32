from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import CurrentUser, ReadSessionDep, SettingsDep
from service.api.routing import SessionScopedRoute
from service.schemas.nodes import ClusterPublic
from service.services.cluster import cluster_view

router = APIRouter(prefix="/v1/cluster", tags=["cluster"], route_class=SessionScopedRoute)


@router.get("")
def get_cluster(session: ReadSessionDep, settings: SettingsDep, user: CurrentUser) -> ClusterPublic:
    """Nodes with processing units, free units, accelerator, health and the attempts they run;
    the cluster's limits (max nodes, units of the largest node) that submissions are checked against."""
    return cluster_view(session, settings, user)
