"""The model store: each succeeded job's model directory, as ``<data dir>/models/<job id>.tar.gz``.

Node rank 0's agent uploads the archive while it holds its lease. The body is streamed
to a temporary file beside the store (never held in memory, capped at
``model_max_bytes``), its sha256 compared with the one the agent announced, the
archive checked (see :mod:`torchyard.contract.model_archive`), and only then moved into place
with an atomic rename and recorded on the job (``model_sha256``, ``model_size``).
Anything that fails on the way leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from service.db.models import Job, Node, Placement
from service.db.types import utcnow
from service.services.incoming import IncomingModelArchive
from service.services.job_lookup import get_job
from service.services.leases import lock_lease, placement_for_lease, speaks_for
from service.services.tokens import Principal
from service.states import PLACED_STATUSES, JobStatus, PlacementStatus
from torchyard.contract.errors import (
    ConflictError,
    ModelNotReadyError,
    NotFoundError,
    PermissionDeniedError,
    RequestValidationError,
    StaleLeaseError,
)
from torchyard.contract.model_archive import ArchivedFile, extract_model_archive, inspect_model_archive

log = logging.getLogger(__name__)

_JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# Unpacked size allowed per archived byte: weights barely compress, so more is a bomb.
UNPACK_RATIO = 4
# Temporary uploads older than this are left over from a crash and removed.
_STALE_UPLOAD_S = 24 * 3600
_UNPACK_LOCK = threading.Lock()


class ModelStore:
    """Where model archives live: ``<data dir>/models``, uploads in progress in ``.incoming``."""

    def __init__(self, data_dir: Path) -> None:
        self.root = Path(data_dir) / "models"
        self.incoming = self.root / ".incoming"

    def path(self, job_id: str) -> Path:
        if not _JOB_ID.match(job_id):
            raise NotFoundError(f"job {job_id!r} not found")
        return self.root / f"{job_id}.tar.gz"

    def unpacked(self, job_id: str, sha256: str, max_unpacked_bytes: int) -> Path:
        """The job's model directory, unpacked once (checked against its manifest) into
        ``models/unpacked/<job id>-<sha256 prefix>``; scoring and the ONNX download read it."""
        dest = self.root / "unpacked" / f"{job_id}-{sha256[:16]}"
        if (dest / "config.json").is_file():
            return dest
        with _UNPACK_LOCK:
            if not (dest / "config.json").is_file():
                extract_model_archive(self.path(job_id), dest, max_unpacked_bytes=max_unpacked_bytes)
        return dest

    def start_upload(self, max_bytes: int) -> IncomingModelArchive:
        self.incoming.mkdir(parents=True, exist_ok=True)
        self._remove_stale_uploads()
        fd, name = tempfile.mkstemp(prefix="upload-", suffix=".tar.gz", dir=self.incoming)
        return IncomingModelArchive(Path(name), os.fdopen(fd, "wb"), max_bytes)

    def _remove_stale_uploads(self) -> None:
        cutoff = time.time() - _STALE_UPLOAD_S
        for path in self.incoming.glob("upload-*"):
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink()
            except FileNotFoundError:
                pass


def check_sha256_header(value: str | None) -> str:
    digest = (value or "").strip().lower()
    if not _SHA256.match(digest):
        raise RequestValidationError(
            "the X-Torchyard-Sha256 header must be the archive's sha256 as 64 hex digits"
        )
    return digest


def authorize_model_upload(
    session: Session, principal: Principal, job_id: str, lease_token: str | None
) -> None:
    """Refuse an upload before its body is read: stale lease (409) or not node rank 0 (403).

    :func:`publish_model` checks again under the locks once the body has arrived.
    """
    placement = placement_for_lease(session, principal, lease_token)
    if placement.job_id != job_id:
        raise StaleLeaseError("the lease belongs to another job")
    _check_uploader(session.get_one(Job, job_id), placement.node_rank)


def _check_uploader(job: Job, node_rank: int) -> None:
    if node_rank != 0:
        raise PermissionDeniedError("only node rank 0 uploads the model directory")
    if job.status not in PLACED_STATUSES:
        raise ConflictError(f"job {job.id} is {job.status}: its model can no longer be uploaded")


def check_sha256_matches(announced: str, actual: str) -> None:
    """422 when the received body is not what its ``X-Torchyard-Sha256`` header announced."""
    if actual != announced:
        raise RequestValidationError(
            f"sha256 mismatch: the header announced {announced}, the body hashes to {actual}",
            details={"expected": announced, "received": actual},
        )


def check_model_upload(incoming: IncomingModelArchive) -> dict[str, ArchivedFile]:
    """The received archive (its checksum already checked) is a valid model archive."""
    return inspect_model_archive(incoming.path, max_unpacked_bytes=incoming.max_bytes * UNPACK_RATIO)


def publish_model(
    session: Session,
    principal: Principal,
    store: ModelStore,
    job_id: str,
    lease_token: str | None,
    incoming: IncomingModelArchive,
    sha256: str,
) -> Job:
    """Move a checked upload into the store and record it on the job, under the lease; commits."""
    job, placement = lock_lease(session, principal, lease_token, job_id=job_id)
    _check_uploader(job, placement.node_rank)
    target = store.path(job_id)
    job.model_sha256 = sha256
    job.model_size = incoming.size
    job.updated_at = utcnow()
    session.flush()
    os.replace(incoming.path, target)
    fsync_dir(target.parent)
    session.commit()
    log.info("job %s: model archive stored (%d bytes, sha256 %s)", job_id, incoming.size, sha256)
    return job


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ModelFile:
    path: Path
    sha256: str
    size: int
    filename: str


def _download_name(job: Job) -> str:
    return f"{job.name}-{job.id}.tar.gz"


def _model_file(store: ModelStore, job: Job) -> ModelFile:
    if job.status != JobStatus.SUCCEEDED or job.model_sha256 is None:
        raise ModelNotReadyError(
            f"job {job.id} is {job.status}: its model directory is available once it has succeeded"
        )
    path = store.path(job.id)
    if not path.is_file():
        raise NotFoundError(f"the model archive of job {job.id} is missing from the artifact store")
    return ModelFile(
        path=path, sha256=job.model_sha256, size=job.model_size or 0, filename=_download_name(job)
    )


def model_for_user(session: Session, principal: Principal, store: ModelStore, job_id: str) -> ModelFile:
    """The model archive of the principal's succeeded job; 409 ``ModelNotReadyError`` before."""
    return _model_file(store, get_job(session, principal, job_id))


def model_for_worker(session: Session, principal: Principal, store: ModelStore, job_id: str) -> ModelFile:
    """A succeeded job's model archive, for an agent fine-tuning from it. Only for a worker
    token whose nodes ran that job, or run (now) a job that starts from its model."""
    job = session.get(Job, job_id)
    if job is None:
        raise NotFoundError(f"job {job_id!r} not found")
    ran_it = Placement.job_id == job.id
    fine_tunes_from_it = and_(Placement.status != PlacementStatus.DONE, Job.init_from_job_id == job.id)
    placed = session.scalars(
        select(Placement.id)
        .join(Node, Node.id == Placement.node_id)
        .join(Job, Job.id == Placement.job_id)
        .where(speaks_for(principal), or_(ran_it, fine_tunes_from_it))
        .limit(1)
    ).first()
    if placed is None:
        raise PermissionDeniedError(
            f"the model of job {job_id!r} is not used by any job placed on this worker's nodes"
        )
    return _model_file(store, job)
