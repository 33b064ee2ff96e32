"""What a job reported, read back by its owner: metric history, log streams and logs.

Another user's job is 404. ``logs?follow=true`` streams (see ``streams.py`` for SSE).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from pydantic import StringConstraints

from service.api.deps import CurrentUser, ReadSessionDep
from service.api.routes.streams import follow_log_response
from service.api.routing import SessionScopedRoute
from service.schemas.reports import LogStreams, MetricSeriesPage
from service.services import jobs as jobs_service
from service.services import log_reads, metric_points
from service.services import metric_series as series_service
from torchyard.contract.errors import RequestValidationError
from torchyard.contract.metrics import METRIC_NAME_PATTERN
from torchyard.contract.reports import INT32_MAX, MAX_RANK
from torchyard.contract.responses import MetricPage, MetricSeries

router = APIRouter(route_class=SessionScopedRoute)

DEFAULT_LOG_BYTES = 1 << 20
MAX_LOG_BYTES = 16 << 20
SEQ_MAX = 2**63 - 1  # seq columns are 64-bit: a larger cursor cannot be a bound parameter


@router.get("/v1/jobs/{job_id}/metrics", tags=["jobs"])
def get_metrics(
    job_id: str,
    session: ReadSessionDep,
    user: CurrentUser,
    name: Annotated[
        list[Annotated[str, StringConstraints(pattern=METRIC_NAME_PATTERN)]] | None,
        Query(description="Only these metrics (repeatable): a trainer metric or a script's own name."),
    ] = None,
    after: Annotated[
        int, Query(ge=0, le=SEQ_MAX, description="Only points with a larger seq (a cursor).")
    ] = 0,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    include_superseded: Annotated[
        bool,
        Query(
            description="Also the points of epochs that a later attempt redid after a restart "
            "(each point carries its attempt). Default: each (name, epoch, step, rank) once, "
            "from the latest attempt that reported it."
        ),
    ] = False,
) -> MetricPage:
    """The job's metric history in seq order. Poll with ``after=<next_after>`` for new points."""
    job = jobs_service.get_job(session, user, job_id)
    items = metric_points.metric_points_after(
        session, job.id, after, name, limit, include_superseded=include_superseded
    )
    return MetricPage(items=items, next_after=items[-1].seq if items else after)


@router.get("/v1/jobs/{job_id}/metrics/series", tags=["jobs"])
def get_metric_series(
    job_id: str,
    session: ReadSessionDep,
    user: CurrentUser,
    points: Annotated[
        int, Query(ge=10, le=100_000, description="At most this many points per metric (about).")
    ] = 2000,
) -> MetricSeriesPage:
    """Every metric of the job as x (step) / y arrays for charts. A metric with more than
    ``points`` points is reduced to about that many: the lowest and highest value of each of
    ``points / 2`` equal stretches of steps (spikes stay visible), then its last point.
    Points that a later attempt reported again are left out, as in the default metrics
    history. ``last_seq`` says where live points continue."""
    job = jobs_service.get_job(session, user, job_id)
    series, last_seq = series_service.metric_series(session, job.id, points)
    return MetricSeriesPage(
        series={name: MetricSeries(x=s.x, y=s.y, count=s.count) for name, s in series.items()},
        points=points,
        last_seq=last_seq,
    )


_LOG_HEADERS = {
    "X-Next-Offset": {"description": "The offset to ask for next.", "schema": {"type": "integer"}},
    "X-Stream-Complete": {
        "description": "true when the attempt has ended and the whole stream was read.",
        "schema": {"type": "string"},
    },
}


@router.get(
    "/v1/jobs/{job_id}/logs",
    tags=["jobs"],
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "headers": _LOG_HEADERS}},
)
def get_logs(
    job_id: str,
    request: Request,
    session: ReadSessionDep,
    user: CurrentUser,
    rank: Annotated[int | None, Query(ge=0, le=MAX_RANK, description="A rank's log (default 0).")] = None,
    stream: Annotated[
        str | None,
        Query(
            max_length=210,
            description="agent, agent-<node>, rank-<N> or file-<node rank>/<path>, instead of rank.",
        ),
    ] = None,
    offset: Annotated[int, Query(ge=0, le=2**62, description="Byte offset to read from.")] = 0,
    limit_bytes: Annotated[int, Query(ge=1, le=MAX_LOG_BYTES)] = DEFAULT_LOG_BYTES,
    attempt: Annotated[
        int | None, Query(ge=1, le=INT32_MAX, description="Attempt number (default latest).")
    ] = None,
    follow: Annotated[bool, Query(description="Stream the text as it arrives until the job ends.")] = False,
    tail: Annotated[
        int | None, Query(ge=1, le=1_000_000, description="Begin at the start of the last this many lines.")
    ] = None,
    since: Annotated[
        datetime | None,
        Query(description="Begin with the text that arrived at or after this time (ISO 8601, with a zone)."),
    ] = None,
) -> Response:
    """A log stream as text from byte ``offset``: a rank's output or the agent's launcher log.
    Continue from ``X-Next-Offset``; ``X-Stream-Complete: true`` says nothing more will come.
    With ``follow=true`` the body streams new text as it arrives and ends with the job.
    ``tail`` and ``since`` move the start later (never earlier than ``offset``)."""
    job = jobs_service.get_job(session, user, job_id)
    chosen = log_reads.resolve_attempt(session, job, attempt)
    name = log_reads.resolve_stream(session, job, chosen, rank=rank, stream=stream)
    if since is not None and since.tzinfo is None:
        raise RequestValidationError(
            "since needs a time zone, e.g. 2026-01-02T03:04:05Z", details={"field": "since"}
        )
    if tail is not None or since is not None:
        offset = max(offset, log_reads.start_offset(session, job, chosen, name, tail=tail, since=since))
    if follow:
        # The session is closed as this returns (SessionScopedRoute): a follower holds
        # no connection while it streams.
        resolved = (chosen.number if chosen is not None else None, name)
        return follow_log_response(
            request,
            job.id,
            rank=rank,
            stream=stream,
            attempt=attempt,
            offset=offset,
            resolved=resolved,
            user=user,
        )
    piece = log_reads.read_log(session, job, chosen, name, offset, limit_bytes)
    headers = {
        "X-Offset": str(piece.offset),
        "X-Next-Offset": str(piece.next_offset),
        "X-Stream-Complete": "true" if piece.complete else "false",
        "Cache-Control": "no-store",
    }
    if piece.stream is not None:
        headers["X-Log-Stream"] = piece.stream
    if piece.attempt is not None:
        headers["X-Log-Attempt"] = str(piece.attempt)
    return Response(piece.data, media_type="text/plain; charset=utf-8", headers=headers)


@router.get("/v1/jobs/{job_id}/logs/streams", tags=["jobs"])
def get_log_streams(
    job_id: str,
    session: ReadSessionDep,
    user: CurrentUser,
    attempt: Annotated[
        int | None, Query(ge=1, le=INT32_MAX, description="Attempt number (default latest).")
    ] = None,
) -> LogStreams:
    """The attempt's log streams (every rank and each node's agent log) with their sizes."""
    job = jobs_service.get_job(session, user, job_id)
    return log_reads.list_streams(session, job, log_reads.resolve_attempt(session, job, attempt))
