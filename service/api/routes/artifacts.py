"""Model archives: node rank 0 uploads a job's model directory; users and fine-tuning
agents download it.

* ``PUT /v1/worker/jobs/{id}/model``: the model directory archive (node rank 0), with
  ``X-Torchyard-Sha256`` and the placement's lease;
* ``GET /v1/worker/jobs/{id}/model``: a succeeded job's archive, for ``init_from_job``;
* ``GET /v1/jobs/{id}/model``: the user's download (``ETag``, ``Range``; 409 until the
  job succeeded; another user's job is 404).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Request, Response

from service.api.deps import CurrentUser, DatabaseDep, LeaseHeader, SettingsDep, WorkerDep
from service.api.files import file_response
from service.api.routing import SessionScopedRoute
from service.api.uploads import receive_fenced_upload
from service.db.engine import Database
from service.schemas.reports import ModelUploaded
from service.services import artifacts
from service.services.artifacts import ModelFile, ModelStore
from service.services.tokens import Principal
from torchyard.contract.model_archive import SHA256_HEADER

router = APIRouter(route_class=SessionScopedRoute)


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
    store = ModelStore(settings.data_dir)
    upload = await receive_fenced_upload(
        request,
        db,
        what="model archive",
        announced=announced,
        limit=settings.model_max_bytes,
        authorize=lambda session: artifacts.authorize_model_upload(session, worker, job_id, lease),
        start=store.start_upload,
        check=artifacts.check_model_upload,
        publish=lambda session, incoming, actual: artifacts.publish_model(
            session, worker, store, job_id, lease, incoming, actual
        ),
    )
    files = upload.checked
    return ModelUploaded(
        sha256=upload.sha256, size=upload.size, files={n: f.sha256 for n, f in files.items()}
    )


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
    return file_response(request, _worker_model(db, worker, ModelStore(settings.data_dir), job_id))


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
    return file_response(request, _user_model(db, user, ModelStore(settings.data_dir), job_id))
