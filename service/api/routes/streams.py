"""Streaming routes: a job's server-sent events and the ``follow=true`` body of its logs.

No request here holds a database connection or a thread while it streams: the job is
checked with a short session in the threadpool, then the body is an async generator
fed by the process's :class:`~service.services.streams.StreamHub`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Header, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from service.api.deps import CurrentUser, DatabaseDep
from service.api.routing import SessionScopedRoute
from service.api.sse import EventFilter, sse_events, sse_job_list
from service.db.engine import Database
from service.services import jobs as jobs_service
from service.services.log_follow import LogTarget, follow_log
from service.services.stream_auth import while_token_valid
from service.services.stream_items import Cursor
from service.services.streams import StreamHub
from service.services.tokens import Principal
from torchyard.contract.reports import MAX_RANK

_STREAM_HEADERS = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


def hub_for(app: Any) -> StreamHub:
    """The app's stream hub (made at startup; made here when the app started without it)."""
    hub: StreamHub | None = getattr(app.state, "stream_hub", None)
    if hub is None:
        hub = StreamHub(app.state.db)
        hub.start()
        app.state.stream_hub = hub
    return hub


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    hub_for(app)
    try:
        yield
    finally:
        hub: StreamHub | None = getattr(app.state, "stream_hub", None)
        if hub is not None:
            await hub.close()
            app.state.stream_hub = None


router = APIRouter(tags=["jobs"], lifespan=lifespan, route_class=SessionScopedRoute)


# Included before the jobs router, so that /v1/jobs/events is not taken for a job id.
list_router = APIRouter(tags=["jobs"], route_class=SessionScopedRoute)


@list_router.get(
    "/v1/jobs/events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def job_list_stream(db: DatabaseDep, user: CurrentUser) -> StreamingResponse:
    """Server-sent ``job`` events whenever one of your jobs changes (status, waiting reason,
    progress): ``{id, name, status, reason, progress, created_at, updated_at, started_at,
    finished_at}``. Only changes after the connection opened; the web UI's jobs list uses it."""
    body = while_token_valid(db, user, sse_job_list(db, user))
    return StreamingResponse(body, media_type="text/event-stream", headers=_STREAM_HEADERS)


def _check_job(db: Database, user: Principal, job_id: str) -> str:
    with db.read_session() as session:
        return jobs_service.get_job(session, user, job_id).id


@router.get(
    "/v1/jobs/{job_id}/events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def job_events(
    job_id: str,
    request: Request,
    db: DatabaseDep,
    user: CurrentUser,
    metrics: Annotated[bool, Query(description="Send metric points.")] = True,
    logs: Annotated[bool, Query(description="Send log chunks.")] = True,
    rank: Annotated[
        list[Annotated[int, Query(ge=0, le=MAX_RANK)]] | None,
        Query(description="Only these ranks' logs (repeatable; default all)."),
    ] = None,
    agent: Annotated[bool, Query(description="Send the agents' launcher logs.")] = True,
    last_event_id: Annotated[
        str | None, Header(alias="Last-Event-ID", max_length=80, description="Resume after this event.")
    ] = None,
    resume: Annotated[
        str | None, Query(max_length=80, description="Resume after this event id (like Last-Event-ID).")
    ] = None,
) -> StreamingResponse:
    """Server-sent events of a job, from its beginning (or after ``Last-Event-ID``) until its
    final status, which is always the last event.

    Events: ``status`` (``{seq, status, message, at}``; the final one adds ``final``,
    ``failure``, ``best``, ``result``, ``model_sha256``), ``metric`` (a metric point) and
    ``log`` (``{seq, stream, rank, attempt, offset, text}``, a chunk of a log stream).
    Each event's id is the position after it: reconnecting with it as ``Last-Event-ID``
    continues with no gap and no duplicate. A client that resumes after the final status
    gets one ``end`` event. Comment lines keep an idle connection alive."""
    start = Cursor.decode(last_event_id or resume)
    checked = await run_in_threadpool(_check_job, db, user, job_id)
    wanted = EventFilter(
        metrics=metrics, logs=logs, ranks=frozenset(rank) if rank is not None else None, agent=agent
    )
    body = while_token_valid(db, user, sse_events(hub_for(request.app), checked, start, wanted))
    return StreamingResponse(body, media_type="text/event-stream", headers=_STREAM_HEADERS)


def follow_log_response(
    request: Request,
    job_id: str,
    *,
    rank: int | None,
    stream: str | None,
    attempt: int | None,
    offset: int,
    resolved: tuple[int | None, str | None] | None = None,
    user: Principal | None = None,
) -> StreamingResponse:
    """The ``follow=true`` answer of ``GET /v1/jobs/{id}/logs``: the stream's text from
    ``offset`` as it arrives, ending when the job is final and every chunk is out.

    The caller has checked the job and the stream name (``resolved``: the attempt number
    and stream name it found) and holds no session any more."""
    target = LogTarget(rank, stream, attempt)

    async def body() -> AsyncIterator[bytes]:
        async for data in follow_log(hub_for(request.app), job_id, target, offset, resolved):
            yield data

    text: AsyncIterator[bytes] = body()
    if user is not None:
        text = while_token_valid(request.app.state.db, user, text)
    return StreamingResponse(text, media_type="text/plain; charset=utf-8", headers=_STREAM_HEADERS)
