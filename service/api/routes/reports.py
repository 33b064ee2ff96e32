"""Reporting routes: agents send metrics, logs, progress and the model; users read them back.

Worker side (worker token, ``X-Torchyard-Lease`` header; a stale lease is 409
``StaleLeaseError`` and writes nothing):

* ``POST /v1/worker/jobs/{id}/reports``: a batch of metric points, log chunks, progress, result;
* ``PUT /v1/worker/jobs/{id}/model``: the model directory archive (node rank 0), with
  ``X-Torchyard-Sha256``;
* ``GET /v1/worker/jobs/{id}/model``: a succeeded job's archive, for ``init_from_job``.

User side (another user's job is 404): metrics, logs, log streams and the model download.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, BinaryIO
from urllib.parse import quote

import anyio
from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from service.api.deps import CurrentUser, DatabaseDep, ReadSessionDep, SessionDep, SettingsDep, WorkerDep
from service.api.routes.streams import follow_log_response
from service.api.routing import SessionScopedRoute, UnicodeCheckedRequest
from service.db.engine import Database
from service.schemas.reports import (
    INT32_MAX,
    MAX_RANK,
    MAX_REPORT_BODY_BYTES,
    LogStreams,
    MetricName,
    MetricPage,
    ModelUploaded,
    ReportAccepted,
    ReportBatch,
)
from service.services import artifacts
from service.services import jobs as jobs_service
from service.services import reports as reports_service
from service.services.artifacts import IncomingModel, ModelFile, ModelStore
from service.services.leases import LEASE_HEADER
from service.services.tokens import Principal
from torchyard.errors import PayloadTooLargeError
from torchyard.model_archive import SHA256_HEADER

router = APIRouter(route_class=SessionScopedRoute)

LeaseHeader = Annotated[str | None, Header(alias=LEASE_HEADER, description="The placement's lease token.")]
_WRITE_CHUNK = 1 << 20
_READ_CHUNK = 256 * 1024
DEFAULT_LOG_BYTES = 1 << 20
MAX_LOG_BYTES = 16 << 20
SEQ_MAX = 2**63 - 1  # seq columns are 64-bit: a larger cursor cannot be a bound parameter


# --- worker side ----------------------------------------------------------------------------


class _CappedRequest(UnicodeCheckedRequest):
    """A request whose body is read with a size cap: 413 ``PayloadTooLargeError`` past it.

    (An HTTP error, since FastAPI turns other errors raised while reading a body into 400.)
    """

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            too_large = HTTPException(413, f"a report batch holds at most {MAX_REPORT_BODY_BYTES} bytes")
            declared = self.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > MAX_REPORT_BODY_BYTES:
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


_reports_router = APIRouter(route_class=_CappedBodyRoute)


@_reports_router.post("/v1/worker/jobs/{job_id}/reports", tags=["worker"])
def post_report(
    job_id: str, batch: ReportBatch, session: SessionDep, worker: WorkerDep, lease: LeaseHeader = None
) -> ReportAccepted:
    """Store a batch of metric points and log chunks and update the job's progress, best
    metrics and result. Idempotent: points and chunks already stored are skipped."""
    return reports_service.ingest_report(session, worker, job_id, lease, batch)


router.include_router(_reports_router)


def _authorize_upload(db: Database, worker: Principal, job_id: str, lease: str | None) -> None:
    with db.read_session() as session:
        artifacts.authorize_model_upload(session, worker, job_id, lease)


def _publish(
    db: Database,
    worker: Principal,
    store: ModelStore,
    job_id: str,
    lease: str | None,
    incoming: IncomingModel,
    sha256: str,
) -> None:
    with db.session() as session:
        artifacts.publish_model(session, worker, store, job_id, lease, incoming, sha256)


@router.put(
    "/v1/worker/jobs/{job_id}/model",
    tags=["worker"],
    openapi_extra={"requestBody": {"required": True, "content": {"application/gzip": {}}}},
)
async def upload_model(
    job_id: str,
    request: Request,
    db: DatabaseDep,
    settings: SettingsDep,
    worker: WorkerDep,
    lease: LeaseHeader = None,
    sha256: Annotated[
        str | None, Header(alias=SHA256_HEADER, description="sha256 of the archive, 64 hex digits.")
    ] = None,
) -> ModelUploaded:
    """Upload the model directory as a .tar.gz (node rank 0 only). The body is streamed to
    disk, its sha256 must match the header (422 otherwise, nothing kept) and the archive
    must hold a complete model directory whose files match its manifest."""
    announced = artifacts.check_sha256_header(sha256)
    await run_in_threadpool(_authorize_upload, db, worker, job_id, lease)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > settings.model_max_bytes:
        raise PayloadTooLargeError(f"model archive exceeds the limit of {settings.model_max_bytes} bytes")
    store = ModelStore(settings.data_dir)
    incoming = await run_in_threadpool(store.start_upload, settings.model_max_bytes)
    try:
        buffer = bytearray()
        async for chunk in request.stream():
            buffer += chunk
            if len(buffer) >= _WRITE_CHUNK:
                await run_in_threadpool(incoming.write, bytes(buffer))
                buffer.clear()
        await run_in_threadpool(incoming.write, bytes(buffer))
        actual = await run_in_threadpool(incoming.finish)
        files = await run_in_threadpool(artifacts.check_model_upload, incoming, announced, actual)
        await run_in_threadpool(_publish, db, worker, store, job_id, lease, incoming, actual)
    finally:
        await run_in_threadpool(incoming.discard)
    return ModelUploaded(sha256=actual, size=incoming.size, files={n: f.sha256 for n, f in files.items()})


def _worker_model(db: Database, worker: Principal, store: ModelStore, job_id: str) -> ModelFile:
    with db.read_session() as session:
        return artifacts.model_for_worker(session, worker, store, job_id)


@router.head("/v1/worker/jobs/{job_id}/model", include_in_schema=False)
@router.get("/v1/worker/jobs/{job_id}/model", tags=["worker"], response_class=Response)
def download_model_for_worker(
    job_id: str, request: Request, db: DatabaseDep, settings: SettingsDep, worker: WorkerDep
) -> Response:
    """A succeeded job's model archive, for agents initialising a fine-tuning job from it:
    403 unless this worker token's nodes ran that job or run one that starts from its model."""
    return _file_response(request, _worker_model(db, worker, ModelStore(settings.data_dir), job_id))


# --- user side ------------------------------------------------------------------------------


@router.get("/v1/jobs/{job_id}/metrics", tags=["jobs"])
def get_metrics(
    job_id: str,
    session: ReadSessionDep,
    user: CurrentUser,
    name: Annotated[list[MetricName] | None, Query(description="Only these metrics (repeatable).")] = None,
    after: Annotated[
        int, Query(ge=0, le=SEQ_MAX, description="Only points with a larger seq (a cursor).")
    ] = 0,
    limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
) -> MetricPage:
    """The job's metric history in seq order. Poll with ``after=<next_after>`` for new points."""
    job = jobs_service.get_job(session, user, job_id)
    items = reports_service.metric_points_after(session, job.id, after, name, limit)
    return MetricPage(items=items, next_after=items[-1].seq if items else after)


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
        str | None, Query(max_length=210, description="agent, agent-<node> or rank-<N>, instead of rank.")
    ] = None,
    offset: Annotated[int, Query(ge=0, le=2**62, description="Byte offset to read from.")] = 0,
    limit_bytes: Annotated[int, Query(ge=1, le=MAX_LOG_BYTES)] = DEFAULT_LOG_BYTES,
    attempt: Annotated[
        int | None, Query(ge=1, le=INT32_MAX, description="Attempt number (default latest).")
    ] = None,
    follow: Annotated[bool, Query(description="Stream the text as it arrives until the job ends.")] = False,
) -> Response:
    """A log stream as text from byte ``offset``: a rank's output or the agent's launcher log.
    Continue from ``X-Next-Offset``; ``X-Stream-Complete: true`` says nothing more will come.
    With ``follow=true`` the body streams new text as it arrives and ends with the job."""
    job = jobs_service.get_job(session, user, job_id)
    chosen = reports_service.resolve_attempt(session, job, attempt)
    name = reports_service.resolve_stream(session, job, chosen, rank=rank, stream=stream)
    if follow:
        # The session is closed as this returns (SessionScopedRoute): a follower holds
        # no connection while it streams.
        resolved = (chosen.number if chosen is not None else None, name)
        return follow_log_response(
            request, job.id, rank=rank, stream=stream, attempt=attempt, offset=offset, resolved=resolved
        )
    piece = reports_service.read_log(session, job, chosen, name, offset, limit_bytes)
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
    return reports_service.list_streams(session, job, reports_service.resolve_attempt(session, job, attempt))


def _user_model(db: Database, user: Principal, store: ModelStore, job_id: str) -> ModelFile:
    with db.read_session() as session:
        return artifacts.model_for_user(session, user, store, job_id)


@router.head("/v1/jobs/{job_id}/model", include_in_schema=False)
@router.get(
    "/v1/jobs/{job_id}/model",
    tags=["jobs"],
    response_class=Response,
    responses={
        200: {"content": {"application/gzip": {}}, "description": "The model directory as .tar.gz."},
        206: {"description": "The requested byte range."},
        304: {"description": "If-None-Match matched: the copy the client has is current."},
        409: {"description": "ModelNotReadyError: the job has not succeeded."},
        416: {"description": "The range starts beyond the end of the archive."},
    },
)
def download_model(
    job_id: str, request: Request, db: DatabaseDep, settings: SettingsDep, user: CurrentUser
) -> Response:
    """The trained model directory as .tar.gz; ``ETag`` is its sha256. Supports a single
    ``Range`` (resume), ``If-Range`` and ``If-None-Match``. 409 until the job succeeded."""
    return _file_response(request, _user_model(db, user, ModelStore(settings.data_dir), job_id))


# --- file responses -------------------------------------------------------------------------


class _Unsatisfiable(Exception):
    pass


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The inclusive byte range of a single-range ``Range`` header, or None to send it all.

    Headers this server does not honour (other units, several ranges, malformed) are
    ignored as RFC 9110 allows; a range starting past the end raises ``_Unsatisfiable``.
    """
    if not header:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = (part.strip() for part in spec.partition("-"))
    # isdecimal, not isdigit: "²" is a digit that int() refuses.
    if (
        not dash
        or not (first or last)
        or (first and not first.isdecimal())
        or (last and not last.isdecimal())
    ):
        return None
    if not first:  # the last N bytes
        length = int(last)
        if length == 0 or size == 0:
            raise _Unsatisfiable
        return max(0, size - length), size - 1
    start = int(first)
    if last and int(last) < start:
        return None
    if start >= size:
        raise _Unsatisfiable
    return start, min(int(last), size - 1) if last else size - 1


def _etags(header: str) -> list[str]:
    return [tag.strip().removeprefix("W/") for tag in header.split(",") if tag.strip()]


def _content_disposition(filename: str) -> str:
    ascii_name = re.sub(r"[^A-Za-z0-9._-]+", "_", filename)
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(filename, safe='')}"


async def _file_chunks(fh: BinaryIO, start: int, length: int) -> Any:
    try:
        position, remaining = start, length
        while remaining > 0:
            chunk = await anyio.to_thread.run_sync(
                os.pread, fh.fileno(), min(_READ_CHUNK, remaining), position
            )
            if not chunk:
                break
            position += len(chunk)
            remaining -= len(chunk)
            yield chunk
    finally:
        fh.close()


def _file_response(request: Request, model: ModelFile) -> Response:
    etag = f'"{model.sha256}"'
    headers = {
        "ETag": etag,
        "Accept-Ranges": "bytes",
        "Content-Disposition": _content_disposition(model.filename),
        "Cache-Control": "private, no-cache",
    }
    if_none_match = request.headers.get("if-none-match")
    if if_none_match is not None and any(tag in (etag, "*") for tag in _etags(if_none_match)):
        return Response(status_code=304, headers=headers)
    fh = open(model.path, "rb")  # noqa: SIM115 - closed by the body iterator
    try:
        size = os.fstat(fh.fileno()).st_size
        if_range = request.headers.get("if-range")
        byte_range = None
        if if_range is None or if_range.strip() == etag:
            byte_range = _parse_range(request.headers.get("range"), size)
    except _Unsatisfiable:
        fh.close()
        return JSONResponse(
            {"code": "RangeNotSatisfiableError", "message": f"the archive has {size} bytes"},
            status_code=416,
            headers={**headers, "Content-Range": f"bytes */{size}"},
        )
    except BaseException:
        fh.close()
        raise
    status = 200
    start, length = 0, size
    if byte_range is not None:
        status = 206
        start, length = byte_range[0], byte_range[1] - byte_range[0] + 1
        headers["Content-Range"] = f"bytes {byte_range[0]}-{byte_range[1]}/{size}"
    headers["Content-Length"] = str(length)
    if request.method == "HEAD":
        fh.close()
        return Response(status_code=status, headers=headers, media_type="application/gzip")
    return StreamingResponse(
        _file_chunks(fh, start, length), status_code=status, headers=headers, media_type="application/gzip"
    )
