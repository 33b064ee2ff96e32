from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from service.api.deps import ReadSessionDep

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz(session: ReadSessionDep) -> dict[str, str]:
    """Liveness and database reachability; needs no token."""
    session.execute(text("SELECT 1"))
    return {"status": "ok"}
