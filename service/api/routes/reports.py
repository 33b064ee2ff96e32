"""Worker report batches: agents send metrics, logs, progress and the result.

``POST /v1/worker/jobs/{id}/reports`` (worker token, ``X-Torchyard-Lease`` header; a
stale lease is 409 ``StaleLeaseError`` and writes nothing). The body is read with a
size cap. Users read what was reported through the routes in ``logs.py``; the model
archive travels through ``artifacts.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.exceptions import HTTPException

from service.api.deps import LeaseHeader, SessionDep, SettingsDep, WorkerDep
from service.api.routing import SessionScopedRoute, UnicodeCheckedRequest
from service.services.metric_store import MetricLimits
from service.services.report_ingest import ingest_report
from torchyard.contract.reports import MAX_REPORT_BODY_BYTES, ReportAccepted, ReportBatch


class _CappedRequest(UnicodeCheckedRequest):
    """A request whose body is read with a size cap: 413 ``PayloadTooLargeError`` past it.

    (An HTTP error, since FastAPI turns other errors raised while reading a body into 400.)
    """

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            too_large = HTTPException(413, f"a report batch holds at most {MAX_REPORT_BODY_BYTES} bytes")
            declared = self.headers.get("content-length", "")
            if declared.isascii() and declared.isdigit() and int(declared) > MAX_REPORT_BODY_BYTES:
                raise too_large
            received = bytearray()
            async for chunk in self.stream():
                received += chunk
                if len(received) > MAX_REPORT_BODY_BYTES:
                    raise too_large
            self._body = bytes(received)
        return self._body


class _CappedBodyRoute(SessionScopedRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def capped(request: Request) -> Response:
            return await handler(_CappedRequest(request.scope, request.receive))

        return capped


router = APIRouter(route_class=_CappedBodyRoute)


@router.post("/v1/worker/jobs/{job_id}/reports", tags=["worker"])
def post_report(
    job_id: str,
    batch: ReportBatch,
    session: SessionDep,
    settings: SettingsDep,
    worker: WorkerDep,
    lease: LeaseHeader = None,
) -> ReportAccepted:
    """Store a batch of metric points and log chunks and update the job's progress, best
    metrics and result. Idempotent: points and chunks already stored are skipped. Points
    past the job's limits (TORCHYARD_MAX_METRIC_POINTS_PER_JOB, TORCHYARD_MAX_METRIC_NAMES_PER_JOB)
    are dropped and counted in ``metrics_dropped``; the rest of the batch is stored."""
    limits = MetricLimits(
        max_points=settings.max_metric_points_per_job, max_names=settings.max_metric_names_per_job
    )
    return ingest_report(session, worker, job_id, lease, batch, limits=limits)
