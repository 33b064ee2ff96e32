"""Script jobs' outputs: agents upload the output folder, users download it.

* ``PUT /v1/worker/jobs/{id}/outputs``: a .tar.gz of a node's output folder, with
  ``X-Torchyard-Sha256`` and the placement's lease (node rank 0; every node with
  ``"outputs": "all"``), either storage;
* ``POST /v1/worker/jobs/{id}/outputs/upload`` and ``.../upload/{upload id}``: a direct
  upload (docs/storage.md): the plan (``mode "api"`` with file storage, and for
  ``"outputs": "all"``, whose served archive the API rebuilds: PUT as above), then its
  completion;
* ``GET /v1/jobs/{id}/outputs``: the archive (``ETag`` = sha256, ``Range``; object storage:
  a redirect to a presigned URL), or one file with ``?path=`` (always from the API, out of
  a copy of the archive it fetched once); 409 until uploaded, another user's job is 404.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from pydantic import BaseModel, Field

from service.api.deps import CurrentUser, DatabaseDep, LeaseHeader, SessionDep, SettingsDep, WorkerDep
from service.api.files import file_response, object_response
from service.api.routing import SessionScopedRoute
from service.api.uploads import receive_fenced_upload
from service.db.engine import Database
from service.services import direct_uploads, outputs
from service.services.artifacts import ModelFile, check_sha256_header
from service.services.outputs import OutputsStore
from service.services.tokens import Principal
from torchyard.contract.headers import SHA256_HEADER
from torchyard.contract.transfer import UploadPlan, UploadRequest

router = APIRouter(route_class=SessionScopedRoute)


class OutputsUploaded(BaseModel):
    sha256: str
    size: int
    files: int | None = Field(
        description="Files in the archive; null for a direct upload, whose bytes the API never reads."
    )


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
    checked, nothing kept on any refusal). 413 past TORCHYARD_MAX_OUTPUTS_BYTES as sent, or
    once unpacked past 100,000 entries or 8 GiB (all nodes' together with ``"outputs": "all"``)."""
    announced = check_sha256_header(sha256)
    limit = settings.max_outputs_bytes
    store = OutputsStore.of(settings)
    upload = await receive_fenced_upload(
        request,
        db,
        what="outputs archive",
        announced=announced,
        limit=limit,
        authorize=lambda session: outputs.authorize_upload(session, worker, job_id, lease),
        start=store.start_upload,
        check=lambda incoming: outputs.check_archive(incoming.path),
        publish=lambda session, incoming, actual: outputs.publish(
            session, worker, store, job_id, lease, incoming, actual
        ),
    )
    return OutputsUploaded(sha256=upload.sha256, size=upload.size, files=upload.checked)


_KIND = "outputs"


@router.post("/v1/worker/jobs/{job_id}/outputs/upload", tags=["worker"])
def plan_outputs_upload(
    job_id: str,
    body: UploadRequest,
    session: SessionDep,
    settings: SettingsDep,
    worker: WorkerDep,
    lease: LeaseHeader = None,
) -> UploadPlan:
    """Where to put a node's outputs archive (stale lease: 409, wrong node: 403): ``mode
    "api"`` with file storage or ``"outputs": "all"`` (PUT it to
    ``/v1/worker/jobs/{id}/outputs``), else presigned parts (docs/storage.md). The same
    request again resumes the upload."""
    outputs.authorize_upload(session, worker, job_id, lease)
    store = OutputsStore.of(settings)
    if not outputs.takes_direct_upload(session, store, job_id):
        return direct_uploads.api_plan(f"/v1/worker/jobs/{job_id}/outputs")
    return direct_uploads.plan_upload(
        session,
        store.storage,
        settings,
        body,
        kind=_KIND,
        owner_id=worker.id,
        job_id=job_id,
        details={"node_rank": 0},
        key_for=lambda upload_id: store.upload_key(job_id, upload_id),
        complete_url=direct_uploads.job_upload_url(job_id, _KIND),
        limit=settings.max_outputs_bytes,
        what="the outputs archive",
    )


@router.post("/v1/worker/jobs/{job_id}/outputs/upload/{upload_id}", tags=["worker"])
def complete_outputs_upload(
    job_id: str,
    upload_id: str,
    db: DatabaseDep,
    settings: SettingsDep,
    worker: WorkerDep,
    lease: LeaseHeader = None,
) -> OutputsUploaded:
    """Record the outputs archive whose parts are in the object store as the job's: 409
    while parts are missing (ask for the plan again), and 409 on a stale lease (the object
    is then removed). The API never reads these bytes: ``files`` is null."""
    store = OutputsStore.of(settings)
    job = direct_uploads.complete_upload(
        db,
        store.storage,
        upload_id,
        kind=_KIND,
        owner_id=worker.id,
        job_id=job_id,
        authorize=lambda session: outputs.authorize_upload(session, worker, job_id, lease),
        publish=lambda session, upload: outputs.publish_direct(session, worker, store, job_id, lease, upload),
    )
    return OutputsUploaded(sha256=job.outputs_sha256 or "", size=job.outputs_size or 0, files=None)


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
        413: {"description": "With path: an archive stored before the caps on outputs, past them."},
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
    store = OutputsStore.of(settings)
    archive = _user_outputs(db, user, store, job_id)
    if path is None:
        return object_response(request, store.storage, archive.key, archive, ttl_s=settings.storage_url_ttl_s)
    single = outputs.output_file(store, archive, job_id, path)
    return file_response(request, single, media_type="application/octet-stream")
