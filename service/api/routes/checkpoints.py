"""Training-state checkpoints (docs/restarts.md), for worker agents only.

* ``PUT /v1/worker/jobs/{id}/checkpoint``: node rank 0 stores a checkpoint under its
  lease, with ``X-Torchyard-Sha256`` and ``X-Torchyard-Checkpoint-Epoch`` (and
  ``-Step`` for a mid-epoch one); the latest two are kept;
* ``GET /v1/worker/jobs/{id}/checkpoint``: the newest checkpoint that still matches
  its sha256, for a placement of that job, with the same headers (object storage: a
  redirect to a presigned URL);
* ``POST /v1/worker/jobs/{id}/checkpoint/upload`` and ``.../upload/{upload id}``: a
  direct upload (docs/storage.md): the plan, then its completion.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Request, Response
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.api.deps import DatabaseDep, LeaseHeader, SessionDep, SettingsDep, WorkerDep
from service.api.files import object_response
from service.api.routing import SessionScopedRoute
from service.api.uploads import receive_fenced_upload
from service.db.engine import Database
from service.services import artifacts, checkpoints, direct_uploads
from service.services.checkpoints import CheckpointFile, CheckpointStore
from service.services.incoming import IncomingCheckpoint
from service.services.tokens import Principal
from torchyard.contract.errors import RequestValidationError
from torchyard.contract.headers import CHECKPOINT_EPOCH_HEADER, CHECKPOINT_STEP_HEADER, SHA256_HEADER
from torchyard.contract.protocol import CheckpointRef
from torchyard.contract.transfer import UploadPlan, UploadRequest

router = APIRouter(route_class=SessionScopedRoute)

_MAX_POSITION = 2**31 - 1


def _position(value: str | None, name: str, *, required: bool) -> int | None:
    text = (value or "").strip()
    if not text:
        if required:
            raise RequestValidationError(f"the {name} header is required")
        return None
    if not text.isdecimal() or int(text) > _MAX_POSITION:
        raise RequestValidationError(f"the {name} header must be a whole number from 0 to {_MAX_POSITION}")
    return int(text)


def _record(
    session: Session,
    worker: Principal,
    store: CheckpointStore,
    job_id: str,
    lease: str | None,
    incoming: IncomingCheckpoint,
    sha256: str,
    epoch: int,
    step: int | None,
) -> CheckpointRef:
    row = checkpoints.record_checkpoint(
        session, worker, store, job_id, lease, incoming, sha256=sha256, epoch=epoch, step=step
    )
    return checkpoints.checkpoint_ref(row)


@router.put(
    "/v1/worker/jobs/{job_id}/checkpoint",
    tags=["worker"],
    openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": {}}}},
)
async def upload_checkpoint(
    job_id: str,
    request: Request,
    db: DatabaseDep,
    settings: SettingsDep,
    worker: WorkerDep,
    lease: LeaseHeader = None,
    sha256: Annotated[
        str | None, Header(alias=SHA256_HEADER, description="sha256 of the body, 64 hex digits.")
    ] = None,
    epoch: Annotated[
        str | None, Header(alias=CHECKPOINT_EPOCH_HEADER, description="Epochs completed when it was written.")
    ] = None,
    step: Annotated[
        str | None,
        Header(
            alias=CHECKPOINT_STEP_HEADER, description="Steps into the next epoch (a mid-epoch checkpoint)."
        ),
    ] = None,
) -> CheckpointRef:
    """Store a training-state checkpoint (node rank 0, live lease of the job: 409
    otherwise). The body is streamed to disk; its sha256 must match the header (422,
    nothing kept). The latest two checkpoints of the job are kept."""
    announced = artifacts.check_sha256_header(sha256)
    epoch_value = _position(epoch, CHECKPOINT_EPOCH_HEADER, required=True)
    assert epoch_value is not None
    step_value = _position(step, CHECKPOINT_STEP_HEADER, required=False)
    store = CheckpointStore.of(settings)
    upload = await receive_fenced_upload(
        request,
        db,
        what="checkpoint",
        announced=announced,
        limit=settings.checkpoint_max_bytes,
        authorize=lambda session: checkpoints.authorize_upload(session, worker, job_id, lease),
        start=store.start_upload,
        check=lambda incoming: None,
        publish=lambda session, incoming, actual: _record(
            session, worker, store, job_id, lease, incoming, actual, epoch_value, step_value
        ),
    )
    return upload.published


def _latest(
    db: Database, worker: Principal, store: CheckpointStore, job_id: str, lease: str | None
) -> CheckpointFile:
    with db.read_session() as session:
        return checkpoints.checkpoint_for_worker(session, worker, store, job_id, lease)


@router.get("/v1/worker/jobs/{job_id}/checkpoint", tags=["worker"], response_class=Response)
async def download_checkpoint(
    job_id: str,
    request: Request,
    db: DatabaseDep,
    settings: SettingsDep,
    worker: WorkerDep,
    lease: LeaseHeader = None,
) -> Response:
    """The job's newest checkpoint whose bytes still match their sha256 (else the previous
    one), for a live placement of that job (409 otherwise; 404 when there is none).
    ``X-Torchyard-Sha256``, ``-Checkpoint-Epoch`` and ``-Checkpoint-Step`` describe it."""
    store = CheckpointStore.of(settings)
    found = await run_in_threadpool(_latest, db, worker, store, job_id, lease)
    headers = {SHA256_HEADER: found.sha256, CHECKPOINT_EPOCH_HEADER: str(found.epoch)}
    if found.step is not None:
        headers[CHECKPOINT_STEP_HEADER] = str(found.step)
    return object_response(
        request,
        store.storage,
        found.key,
        found,
        ttl_s=settings.storage_url_ttl_s,
        media_type="application/octet-stream",
        extra_headers=headers,
    )


_KIND = "checkpoint"


@router.post("/v1/worker/jobs/{job_id}/checkpoint/upload", tags=["worker"])
def plan_checkpoint_upload(
    job_id: str,
    body: UploadRequest,
    session: SessionDep,
    settings: SettingsDep,
    worker: WorkerDep,
    lease: LeaseHeader = None,
    epoch: Annotated[str | None, Header(alias=CHECKPOINT_EPOCH_HEADER)] = None,
    step: Annotated[str | None, Header(alias=CHECKPOINT_STEP_HEADER)] = None,
) -> UploadPlan:
    """Where to put a checkpoint (node rank 0, live lease of the job: 409 otherwise):
    ``mode "api"`` with file storage (PUT it to ``/v1/worker/jobs/{id}/checkpoint``), else
    presigned parts (docs/storage.md). The same request again resumes the upload."""
    epoch_value = _position(epoch, CHECKPOINT_EPOCH_HEADER, required=True)
    step_value = _position(step, CHECKPOINT_STEP_HEADER, required=False)
    checkpoints.authorize_upload(session, worker, job_id, lease)
    store = CheckpointStore.of(settings)
    if not store.storage.direct:
        return direct_uploads.api_plan(f"/v1/worker/jobs/{job_id}/checkpoint")
    return direct_uploads.plan_upload(
        session,
        store.storage,
        settings,
        body,
        kind=_KIND,
        owner_id=worker.id,
        job_id=job_id,
        details={"epoch": epoch_value, "step": step_value},
        key_for=lambda upload_id: store.key(job_id, upload_id),
        complete_url=direct_uploads.job_upload_url(job_id, _KIND),
        limit=settings.checkpoint_max_bytes,
        what="the checkpoint",
    )


@router.post("/v1/worker/jobs/{job_id}/checkpoint/upload/{upload_id}", tags=["worker"])
def complete_checkpoint_upload(
    job_id: str,
    upload_id: str,
    db: DatabaseDep,
    settings: SettingsDep,
    worker: WorkerDep,
    lease: LeaseHeader = None,
) -> CheckpointRef:
    """Record a checkpoint whose parts are in the object store: 409 while parts are missing
    (ask for the plan again), and 409 on a stale lease (the object is then removed)."""
    store = CheckpointStore.of(settings)
    row = direct_uploads.complete_upload(
        db,
        store.storage,
        upload_id,
        kind=_KIND,
        owner_id=worker.id,
        job_id=job_id,
        authorize=lambda session: checkpoints.authorize_upload(session, worker, job_id, lease),
        publish=lambda session, upload: checkpoints.record_direct_checkpoint(
            session, worker, store, job_id, lease, upload
        ),
    )
    return checkpoints.checkpoint_ref(row)
