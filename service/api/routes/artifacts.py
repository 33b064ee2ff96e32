"""Model archives: node rank 0 uploads a job's model directory; users and fine-tuning
agents download it.

* ``PUT /v1/worker/jobs/{id}/model``: the model directory archive (node rank 0), with
  ``X-Torchyard-Sha256`` and the placement's lease (either storage);
* ``POST /v1/worker/jobs/{id}/model/upload`` and ``.../upload/{upload id}``: a direct upload
  (docs/storage.md): the plan (``mode "api"`` with file storage: PUT as above), then its
  completion;
* ``GET /v1/worker/jobs/{id}/model``: a succeeded job's archive, for ``init_from_job``;
* ``GET /v1/jobs/{id}/model``: the user's download (``ETag``, ``Range``; 409 until the
  job succeeded; another user's job is 404).

Downloads with object storage are a redirect to a presigned URL of the object (the
``ETag``, the archive's sha256, is the API's, on the redirect).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Request, Response

from service.api.deps import CurrentUser, DatabaseDep, LeaseHeader, SessionDep, SettingsDep, WorkerDep
from service.api.files import object_response
from service.api.routing import SessionScopedRoute
from service.api.uploads import receive_fenced_upload
from service.config import Settings
from service.db.engine import Database
from service.schemas.reports import ModelUploaded
from service.services import artifacts, direct_uploads
from service.services.artifacts import ModelFile, ModelStore
from service.services.tokens import Principal
from torchyard.contract.model_archive import SHA256_HEADER
from torchyard.contract.transfer import UploadPlan, UploadRequest

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
    store = ModelStore.of(settings)
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


_KIND = "model"


@router.post("/v1/worker/jobs/{job_id}/model/upload", tags=["worker"])
def plan_model_upload(
    job_id: str,
    body: UploadRequest,
    session: SessionDep,
    settings: SettingsDep,
    worker: WorkerDep,
    lease: LeaseHeader = None,
) -> UploadPlan:
    """Where to put the model archive (node rank 0, live lease of the job: 409 otherwise):
    ``mode "api"`` with file storage (PUT it to ``/v1/worker/jobs/{id}/model``), else
    presigned parts (docs/storage.md). The same request again resumes the upload."""
    artifacts.authorize_model_upload(session, worker, job_id, lease)
    store = ModelStore.of(settings)
    if not store.storage.direct:
        return direct_uploads.api_plan(f"/v1/worker/jobs/{job_id}/model")
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
        limit=settings.model_max_bytes,
        what="the model archive",
    )


@router.post("/v1/worker/jobs/{job_id}/model/upload/{upload_id}", tags=["worker"])
def complete_model_upload(
    job_id: str,
    upload_id: str,
    db: DatabaseDep,
    settings: SettingsDep,
    worker: WorkerDep,
    lease: LeaseHeader = None,
) -> ModelUploaded:
    """Record the model archive whose parts are in the object store as the job's model:
    409 while parts are missing (ask for the plan again), and 409 on a stale lease (the
    object is then removed). The API never reads these bytes, so ``files`` is empty: the
    agent checked the directory against its manifest before packing it, and every reader
    checks each file against the manifest when unpacking."""
    store = ModelStore.of(settings)
    job = direct_uploads.complete_upload(
        db,
        store.storage,
        upload_id,
        kind=_KIND,
        owner_id=worker.id,
        job_id=job_id,
        authorize=lambda session: artifacts.authorize_model_upload(session, worker, job_id, lease),
        publish=lambda session, upload: artifacts.publish_direct_model(
            session, worker, store, job_id, lease, upload
        ),
    )
    return ModelUploaded(sha256=job.model_sha256 or "", size=job.model_size or 0, files={})


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
    return _serve(request, settings, _worker_model(db, worker, ModelStore.of(settings), job_id))


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
    return _serve(request, settings, _user_model(db, user, ModelStore.of(settings), job_id))


def _serve(request: Request, settings: Settings, found: ModelFile) -> Response:
    """The archive's bytes (file storage) or a redirect to a presigned URL (object storage),
    with the API's ``ETag`` (the archive's sha256) either way."""
    return object_response(
        request,
        ModelStore.of(settings).storage,
        found.key,
        found,
        ttl_s=settings.storage_url_ttl_s,
    )
