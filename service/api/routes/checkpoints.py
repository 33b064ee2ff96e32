"""Training-state checkpoints (docs/restarts.md), for worker agents only.

* ``PUT /v1/worker/jobs/{id}/checkpoint``: node rank 0 stores a checkpoint under its
  lease, with ``X-Torchyard-Sha256`` and ``X-Torchyard-Checkpoint-Epoch`` (and
  ``-Step`` for a mid-epoch one); the latest two are kept;
* ``GET /v1/worker/jobs/{id}/checkpoint``: the newest checkpoint that still matches
  its sha256, for a placement of that job, with the same headers.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Request, Response
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.api.deps import DatabaseDep, LeaseHeader, SettingsDep, WorkerDep
from service.api.files import file_response
from service.api.routing import SessionScopedRoute
from service.api.uploads import receive_fenced_upload
from service.db.engine import Database
from service.services import artifacts, checkpoints
from service.services.checkpoints import CheckpointFile, CheckpointStore
from service.services.incoming import IncomingCheckpoint
from service.services.tokens import Principal
from torchyard.contract.errors import RequestValidationError
from torchyard.contract.headers import CHECKPOINT_EPOCH_HEADER, CHECKPOINT_STEP_HEADER, SHA256_HEADER
from torchyard.contract.protocol import CheckpointRef

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
    store = CheckpointStore(settings.data_dir)
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
    found = await run_in_threadpool(_latest, db, worker, CheckpointStore(settings.data_dir), job_id, lease)
    headers = {SHA256_HEADER: found.sha256, CHECKPOINT_EPOCH_HEADER: str(found.epoch)}
    if found.step is not None:
        headers[CHECKPOINT_STEP_HEADER] = str(found.step)
    return file_response(request, found, media_type="application/octet-stream", extra_headers=headers)
