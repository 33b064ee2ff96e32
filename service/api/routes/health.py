"""Health: liveness (``/healthz``) and readiness (``/readyz``); neither needs a token."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from service.api.deps import DatabaseDep
from service.api.errors import unavailable_response
from service.api.routing import SessionScopedRoute
from service.db.engine import is_unavailable

router = APIRouter(tags=["health"], route_class=SessionScopedRoute)


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """Liveness: the process serves requests. It does not touch the database, so a
    database outage never gets a healthy API restarted; see ``/readyz``."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    responses={503: {"description": "the database is unreachable: send traffic elsewhere"}},
)
async def readyz(request: Request, db: DatabaseDep) -> Any:
    """Readiness: 200 while the database answers, 503 ``ServiceUnavailableError`` (with
    ``Retry-After``) while it does not, so a load balancer stops sending traffic here."""
    try:
        await run_in_threadpool(db.ping)
    except Exception as exc:
        if not is_unavailable(exc):
            raise
        return unavailable_response(request)
    return JSONResponse({"status": "ready", "database": "ok"})
