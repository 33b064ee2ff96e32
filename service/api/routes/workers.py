"""Worker routes: node registration, heartbeats, claims and everything an agent reports."""

from __future__ import annotations

from fastapi import APIRouter

from service.api.deps import SessionDep, WorkerDep
from service.schemas.nodes import NodeRegister
from service.services import nodes as nodes_service

router = APIRouter(prefix="/v1/worker", tags=["worker"])


@router.post("/nodes")
def register_node(body: NodeRegister, session: SessionDep, worker: WorkerDep) -> dict[str, object]:
    """Register (or re-register) this agent's node."""
    node = nodes_service.register_node(
        session,
        worker,
        name=body.name,
        address=body.address,
        units=body.units,
        accelerator=body.accelerator,
        info=body.info,
    )
    session.commit()
    return {"id": node.id, "name": node.name, "status": node.status}
