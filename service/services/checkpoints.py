"""The checkpoint store: each running job's latest training-state checkpoints (docs/restarts.md).

Node rank 0's agent uploads a checkpoint after every epoch (and on preemption) under
the lease of a live placement of the job. The object is
``checkpoints/<job id>/<checkpoint id>.pt`` in the artifact store (docs/storage.md). With
file storage the body comes through the API: streamed to a temporary file (size-capped),
its sha256 compared with the announced one, then renamed into place. With object
storage the agent PUTs it to the store itself (a direct upload, whose id becomes the
checkpoint's id: a new key every time). Either way it is recorded in the ``checkpoints``
table under the lease, in one transaction. The latest two are kept; older ones are
deleted. When the job ends its records go (``jobs.transition`` to a final status) and
the reaper removes the objects (:func:`remove_ended_jobs_files`).

Paths come only from the job id in the URL (checked against the lease) and ids the
server made: an agent can never read another job's checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.engine import Database
from service.db.models import Attempt, Checkpoint, Job, ObjectUpload, Placement
from service.db.types import utcnow
from service.services.direct_uploads import storage_of
from service.services.incoming import IncomingCheckpoint
from service.services.leases import lock_lease, placement_for_lease
from service.services.tokens import Principal
from service.states import ACTIVE_STATUSES, PLACED_STATUSES
from service.storage import FileStorage, ObjectStorage
from service.storage.base import StorageError
from torchyard.contract.errors import ConflictError, NotFoundError, PermissionDeniedError, StaleLeaseError
from torchyard.contract.files import sha256_file
from torchyard.contract.protocol import CheckpointRef

log = logging.getLogger(__name__)

KEEP = 2
_JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class CheckpointStore:
    """``checkpoints/<job id>/`` in the artifact store; uploads through the API in progress
    in ``<data dir>/checkpoints/.incoming``."""

    def __init__(self, data_dir: Path, storage: ObjectStorage | None = None) -> None:
        self.root = Path(data_dir) / "checkpoints"
        self.incoming = self.root / ".incoming"
        self.storage: ObjectStorage = storage if storage is not None else FileStorage(Path(data_dir))

    @classmethod
    def of(cls, settings: Settings) -> CheckpointStore:
        return cls(settings.data_dir, storage_of(settings))

    def job_dir(self, job_id: str) -> Path:
        if not _JOB_ID.match(job_id):
            raise NotFoundError(f"job {job_id!r} not found")
        return self.root / job_id

    def path(self, job_id: str, checkpoint_id: str) -> Path:
        return self.job_dir(job_id) / f"{checkpoint_id}.pt"

    def key(self, job_id: str, checkpoint_id: str) -> str:
        self.job_dir(job_id)
        return f"checkpoints/{job_id}/{checkpoint_id}.pt"

    def start_upload(self, max_bytes: int) -> IncomingCheckpoint:
        self.incoming.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="upload-", suffix=".pt", dir=self.incoming)
        return IncomingCheckpoint(Path(name), os.fdopen(fd, "wb"), max_bytes)


def _check_writer(job: Job, placement: Placement, job_id: str) -> None:
    if placement.job_id != job_id:
        raise StaleLeaseError("the lease belongs to another job")
    if placement.node_rank != 0:
        raise PermissionDeniedError("only node rank 0 uploads the job's checkpoints")
    if job.status not in PLACED_STATUSES:
        raise ConflictError(f"job {job.id} is {job.status}: it takes no more checkpoints")


def authorize_upload(session: Session, principal: Principal, job_id: str, lease_token: str | None) -> None:
    """Refuse an upload before its body is read: stale lease (409), not node rank 0 (403)."""
    placement = placement_for_lease(session, principal, lease_token)
    _check_writer(session.get_one(Job, placement.job_id), placement, job_id)


def record_checkpoint(
    session: Session,
    principal: Principal,
    store: CheckpointStore,
    job_id: str,
    lease_token: str | None,
    incoming: IncomingCheckpoint,
    *,
    sha256: str,
    epoch: int,
    step: int | None,
) -> Checkpoint:
    """Move a verified upload into the store and record it, under the lease; keep the
    latest :data:`KEEP` and delete older ones. Commits."""
    job, placement = lock_lease(session, principal, lease_token, job_id=job_id)
    _check_writer(job, placement, job_id)
    attempt = session.get_one(Attempt, placement.attempt_id)
    row = Checkpoint(
        job_id=job_id,
        attempt_id=attempt.id,
        attempt_number=attempt.number,
        epoch=epoch,
        step=step,
        sha256=sha256,
        size_bytes=incoming.size,
        created_at=utcnow(),
    )
    session.add(row)
    session.flush()
    store.storage.adopt_file(store.key(job_id, row.id), incoming.path)
    return _keep_latest(session, store, job_id, row)


def record_direct_checkpoint(
    session: Session,
    principal: Principal,
    store: CheckpointStore,
    job_id: str,
    lease_token: str | None,
    upload: ObjectUpload,
) -> Checkpoint:
    """Record a checkpoint the agent PUT to the object store (a completed direct upload, its
    object verified), under the lease; its id is the upload's. Commits."""
    job, placement = lock_lease(session, principal, lease_token, job_id=job_id)
    _check_writer(job, placement, job_id)
    attempt = session.get_one(Attempt, placement.attempt_id)
    row = Checkpoint(
        id=upload.id,
        job_id=job_id,
        attempt_id=attempt.id,
        attempt_number=attempt.number,
        epoch=int(upload.details["epoch"]),
        step=upload.details.get("step"),
        sha256=upload.sha256,
        size_bytes=upload.size_bytes,
        created_at=utcnow(),
    )
    session.add(row)
    session.delete(upload)
    session.flush()
    return _keep_latest(session, store, job_id, row)


def _keep_latest(session: Session, store: CheckpointStore, job_id: str, row: Checkpoint) -> Checkpoint:
    older = _records(session, job_id)[KEEP:]
    for old in older:
        session.delete(old)
    session.commit()
    for old in older:
        store.storage.delete(store.key(job_id, old.id))
    log.info(
        "job %s: checkpoint %s stored (epoch %d, step %s, %d bytes)",
        job_id,
        row.id,
        row.epoch,
        row.step,
        row.size_bytes,
    )
    return row


def _records(session: Session, job_id: str) -> list[Checkpoint]:
    """The job's checkpoints, newest first."""
    return list(
        session.scalars(
            select(Checkpoint)
            .where(Checkpoint.job_id == job_id)
            .order_by(Checkpoint.created_at.desc(), Checkpoint.epoch.desc(), Checkpoint.id.desc())
        )
    )


def _sha256_of(path: Path) -> str | None:
    try:
        return sha256_file(path)
    except OSError:
        return None


@dataclass(frozen=True)
class CheckpointFile:
    key: str
    path: Path | None  # where objects are files; None in object storage
    sha256: str
    size: int
    filename: str
    epoch: int
    step: int | None
    attempt: int


def checkpoint_for_worker(
    session: Session, principal: Principal, store: CheckpointStore, job_id: str, lease_token: str | None
) -> CheckpointFile:
    """The newest checkpoint of the job whose bytes still match their sha256 (else the one
    before), for the holder of a live lease of that job. 404 when there is none.

    Files are hashed again here; objects in object storage were verified by the store as
    they arrived and are checked for their size (the agent hashes what it downloads)."""
    placement = placement_for_lease(session, principal, lease_token)
    if placement.job_id != job_id:
        raise StaleLeaseError("the lease belongs to another job")
    for row in _records(session, job_id):
        key = store.key(job_id, row.id)
        path = store.storage.local_path(key)
        if (_sha256_of(path) == row.sha256) if path is not None else _has_size(store, key, row.size_bytes):
            return CheckpointFile(
                key=key,
                path=path,
                sha256=row.sha256,
                size=row.size_bytes,
                filename=f"{job_id}-checkpoint-{row.id}.pt",
                epoch=row.epoch,
                step=row.step,
                attempt=row.attempt_number,
            )
        log.error(
            "job %s: checkpoint %s does not match its sha256 on disk; trying an older one", job_id, row.id
        )
    raise NotFoundError(f"job {job_id} has no checkpoint")


def _has_size(store: CheckpointStore, key: str, size: int) -> bool:
    try:
        found = store.storage.head(key)
    except StorageError as exc:
        log.warning("checkpoint %s: %s", key, exc)
        return False
    return found is not None and found.size == size


def latest_ref(session: Session, store: CheckpointStore | None, job_id: str) -> CheckpointRef | None:
    """The newest checkpoint whose object is present with its recorded size (for a claim)."""
    for row in _records(session, job_id):
        if store is not None and not _has_size(store, store.key(job_id, row.id), row.size_bytes):
            continue
        return checkpoint_ref(row)
    return None


def checkpoint_ref(row: Checkpoint) -> CheckpointRef:
    """What the protocol says of a stored checkpoint."""
    return CheckpointRef(
        epoch=row.epoch,
        step=row.step,
        sha256=row.sha256,
        size_bytes=row.size_bytes,
        attempt=row.attempt_number,
    )


def remove_ended_jobs_files(db: Database, store: CheckpointStore) -> int:
    """Remove the checkpoints of jobs that ended or no longer exist; of how many jobs."""
    if store.storage.local_path("checkpoints") is None:
        names = sorted({info.key.split("/")[1] for info in store.storage.list_objects("checkpoints/")})
    elif store.root.is_dir():
        names = [p.name for p in store.root.iterdir() if p.is_dir()]
    else:
        return 0
    names = [n for n in names if _JOB_ID.match(n)]
    if not names:
        return 0
    with db.read_session() as session:
        live = set(session.scalars(select(Job.id).where(Job.id.in_(names), Job.status.in_(ACTIVE_STATUSES))))
    removed = 0
    for name in names:
        if name not in live:
            if store.storage.local_path("checkpoints") is None:
                store.storage.delete_prefix(f"checkpoints/{name}/")
            else:
                shutil.rmtree(store.root / name, ignore_errors=True)
            removed += 1
    return removed
