from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from service.api.deps import DatabaseDep
from service.api.routing import SessionScopedRoute

router = APIRouter(tags=["health"], route_class=SessionScopedRoute)


@router.get("/healthz")
def healthz(db: DatabaseDep) -> dict[str, str]:
    """Liveness and database reachability; needs no token."""
    # The session is opened and closed inside the request's thread: a burst of health
    # checks (load balancers, a restarting cluster) then never queues on the pool.
    with db.read_session() as session:
        session.execute(text("SELECT 1"))
    return {"status": "ok"}
