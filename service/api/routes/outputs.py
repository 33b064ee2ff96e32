"""Script jobs' outputs: agents upload the output folder, users download it.

* ``PUT /v1/worker/jobs/{id}/outputs``: a .tar.gz of a node's output folder, with
  ``X-Torchyard-Sha256`` and the placement's lease (node rank 0; every node with
  ``"outputs": "all"``);
* ``GET /v1/jobs/{id}/outputs``: the archive (``ETag`` = sha256, ``Range``), or one file
  with ``?path=``; 409 until uploaded, another user's job is 404.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from service.api.deps import CurrentUser, DatabaseDep, LeaseHeader, SettingsDep, WorkerDep
from service.api.files import file_response, receive_body, refuse_oversized
from service.api.routing import SessionScopedRoute
from service.db.engine import Database
from service.services import outputs
from service.services.artifacts import IncomingModel, ModelFile, check_sha256_header
from service.services.outputs import OutputsStore
from service.services.tokens import Principal
from torchyard.contract.headers import SHA256_HEADER

router = APIRouter(route_class=SessionScopedRoute)


class OutputsUploaded(BaseModel):
    sha256: str
    size: int
    files: int


def _authorize(db: Database, worker: Principal, job_id: str, lease: str | None) -> None:
    with db.read_session() as session:
        outputs.authorize_upload(session, worker, job_id, lease)


def _publish(
    db: Database,
    worker: Principal,
    store: OutputsStore,
    job_id: str,
    lease: str | None,
    incoming: IncomingModel,
    sha: str,
) -> None:
    with db.session() as session:
        outputs.publish(session, worker, store, job_id, lease, incoming, sha)


@router.put(
    "/v1/worker/jobs/{job_id}/outputs",
    tags=["worker"],
    openapi_extra={"requestBody": {"required": True, "content": {"application/gzip": {}}}},
)
async def upload_outputs(
    job_id: str,
    request: Request,
    db: DatabaseDep,
    settings: SettingsDep,
    worker: WorkerDep,
    lease: LeaseHeader = None,
    sha256: Annotated[
        str | None, Header(alias=SHA256_HEADER, description="sha256 of the archive, 64 hex digits.")
    ] = None,
) -> OutputsUploaded:
    """Upload a node's output folder as .tar.gz (streamed to disk, checksum and members
    checked, nothing kept on any refusal)."""
    announced = check_sha256_header(sha256)
    await run_in_threadpool(_authorize, db, worker, job_id, lease)
    limit = settings.max_outputs_bytes
    refuse_oversized(request, limit, "outputs archive")
    store = OutputsStore(settings.data_dir)
    incoming = await run_in_threadpool(store.start_upload, limit)
    try:
        actual = await receive_body(request, incoming)
        files = await run_in_threadpool(outputs.check_archive, incoming.path, announced, actual, limit * 4)
        await run_in_threadpool(_publish, db, worker, store, job_id, lease, incoming, actual)
    finally:
        await run_in_threadpool(incoming.discard)
    return OutputsUploaded(sha256=actual, size=incoming.size, files=files)


def _user_outputs(db: Database, user: Principal, store: OutputsStore, job_id: str) -> ModelFile:
    with db.read_session() as session:
        return outputs.outputs_for_user(session, user, store, job_id)


@router.head("/v1/jobs/{job_id}/outputs", include_in_schema=False)
@router.get(
    "/v1/jobs/{job_id}/outputs",
    tags=["jobs"],
    response_class=Response,
    responses={
        200: {"content": {"application/gzip": {}}, "description": "The outputs as .tar.gz, or one file."},
        206: {"description": "The requested byte range."},
        404: {"description": "No such job, or no such file in its outputs."},
        409: {"description": "OutputsNotReadyError: nothing uploaded yet (the job has not ended)."},
    },
)
def download_outputs(
    job_id: str,
    request: Request,
    db: DatabaseDep,
    settings: SettingsDep,
    user: CurrentUser,
    path: Annotated[
        str | None, Query(max_length=4096, description="One file, relative to the output folder.")
    ] = None,
) -> Response:
    """A script job's output folder (node 0's; every node's under ``node-<rank>/`` with
    ``"outputs": "all"``) as .tar.gz, ``ETag`` its sha256, ``Range`` supported; or, with
    ``path``, that one file. Uploaded when the job ends, succeeded or failed."""
    store = OutputsStore(settings.data_dir)
    archive = _user_outputs(db, user, store, job_id)
    if path is None:
        return file_response(request, archive)
    single = outputs.output_file(store, archive, job_id, path)
    return file_response(request, single, media_type="application/octet-stream")
