from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from service.api.deps import ReadSessionDep
from service.api.routing import SessionScopedRoute

router = APIRouter(tags=["health"], route_class=SessionScopedRoute)


@router.get("/healthz")
def healthz(session: ReadSessionDep) -> dict[str, str]:
    """Liveness and database reachability; needs no token."""
    session.execute(text("SELECT 1"))
    return {"status": "ok"}
