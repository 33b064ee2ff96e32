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

from service.api.deps import CurrentUser, DatabaseDep, LeaseHeader, SettingsDep, WorkerDep
from service.api.files import file_response
from service.api.routing import SessionScopedRoute
from service.api.uploads import receive_fenced_upload
from service.db.engine import Database
from service.services import outputs
from service.services.artifacts import ModelFile, check_sha256_header
from service.services.outputs import OutputsStore
from service.services.tokens import Principal
from torchyard.contract.headers import SHA256_HEADER

router = APIRouter(route_class=SessionScopedRoute)


class OutputsUploaded(BaseModel):
    sha256: str
    size: int
    files: int


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
    store = OutputsStore(settings.data_dir)
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
    store = OutputsStore(settings.data_dir)
    archive = _user_outputs(db, user, store, job_id)
    if path is None:
        return file_response(request, archive)
    single = outputs.output_file(store, archive, job_id, path)
    return file_response(request, single, media_type="application/octet-stream")
