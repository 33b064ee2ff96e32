"""The model store: each succeeded job's model directory, as a .tar.gz in the artifact store
(docs/storage.md): ``models/<job id>.tar.gz`` with file storage (``<data dir>/models/``).

Node rank 0's agent uploads the archive while it holds its lease. Through the API
(``PUT``, either storage) the body is streamed to a temporary file beside the store (never
held in memory, capped at ``model_max_bytes``), its sha256 compared with the one the agent
announced, the archive checked (see :mod:`torchyard.contract.model_archive`), and only
then stored and recorded on the job (``model_sha256``, ``model_size``). Anything that
fails on the way leaves nothing behind.

With object storage every upload gets a key of its own, ``models/<job id>/<upload id>.tar.gz``,
recorded in ``jobs.model_key`` in the transaction that publishes it under the lease (the
previous object is removed after it): a stale writer replaces nothing. A direct upload
(the agent PUTs the archive to the store with presigned URLs) is never read by the API:
the agent verified the model directory against its manifest before packing it, and
every reader verifies it again (:func:`~torchyard.contract.model_archive.extract_model_archive`
checks each file against the manifest; agents and the CLI check the archive's sha256).
The API reads an archive in object storage only to unpack it for scoring and ONNX
(fetched once, :meth:`ModelStore.unpacked`).
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

from service.config import Settings
from service.db.models import Job, Node, ObjectUpload, Placement
from service.db.types import new_id, utcnow
from service.services.direct_uploads import storage_of
from service.services.incoming import IncomingModelArchive
from service.services.job_lookup import get_job
from service.services.leases import lock_lease, placement_for_lease, speaks_for
from service.services.tokens import Principal
from service.states import PLACED_STATUSES, JobStatus, PlacementStatus
from service.storage import FileStorage, ObjectStorage
from service.storage.base import StorageError
from torchyard.contract.errors import (
    ConflictError,
    ModelNotReadyError,
    NotFoundError,
    PermissionDeniedError,
    RequestValidationError,
    ServiceUnavailableError,
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
    """Where model archives live: objects ``models/...`` of the artifact store; uploads through
    the API in progress in ``<data dir>/models/.incoming``, unpacked copies in ``models/unpacked``."""

    def __init__(self, data_dir: Path, storage: ObjectStorage | None = None) -> None:
        self.root = Path(data_dir) / "models"
        self.incoming = self.root / ".incoming"
        self.storage: ObjectStorage = storage if storage is not None else FileStorage(Path(data_dir))

    @classmethod
    def of(cls, settings: Settings) -> ModelStore:
        return cls(settings.data_dir, storage_of(settings))

    def path(self, job_id: str) -> Path:
        """The file of the legacy key ``models/<job id>.tar.gz`` (file storage)."""
        if not _JOB_ID.match(job_id):
            raise NotFoundError(f"job {job_id!r} not found")
        return self.root / f"{job_id}.tar.gz"

    def key(self, job_id: str, model_key: str | None = None) -> str:
        """The object of a job's archive: ``model_key`` (a direct or object-storage upload's),
        else the legacy ``models/<job id>.tar.gz``."""
        self.path(job_id)
        return model_key or f"models/{job_id}.tar.gz"

    def upload_key(self, job_id: str, upload_id: str) -> str:
        """The object of one upload of a job's archive (object storage)."""
        self.path(job_id)
        return f"models/{job_id}/{upload_id}.tar.gz"

    def new_key(self, job_id: str) -> str:
        """Where the next archive of the job goes: the legacy file with file storage (the
        layout as it always was), a key of its own with object storage."""
        return self.upload_key(job_id, new_id()) if self.storage.direct else self.key(job_id)

    def drop_replaced(self, job_id: str, previous: str | None, current: str) -> None:
        """Remove the object an archive just published replaced (object storage)."""
        if previous is None or previous == current:
            return
        try:
            self.storage.delete(previous)
        except StorageError as exc:
            log.warning("job %s: could not remove the replaced model archive %s: %s", job_id, previous, exc)

    def unpacked(self, job_id: str, sha256: str, max_unpacked_bytes: int, key: str | None = None) -> Path:
        """The job's model directory, unpacked once (checked against its manifest) into
        ``models/unpacked/<job id>-<sha256 prefix>``; scoring and the ONNX download read it.
        In object storage the archive is fetched into ``.incoming`` for that, then removed.
        404 when the archive is not in the store."""
        dest = self.root / "unpacked" / f"{job_id}-{sha256[:16]}"
        if (dest / "config.json").is_file():
            return dest
        with _UNPACK_LOCK:
            if not (dest / "config.json").is_file():
                self._unpack(self.key(job_id, key), job_id, dest, max_unpacked_bytes)
        return dest

    def _unpack(self, key: str, job_id: str, dest: Path, max_unpacked_bytes: int) -> None:
        local = self.storage.local_path(key)
        if local is not None:
            extract_model_archive(local, dest, max_unpacked_bytes=max_unpacked_bytes)
            return
        if not object_present(self.storage, key):
            raise NotFoundError(f"the model archive of job {job_id} is missing from the artifact store")
        self.incoming.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="upload-fetch-", suffix=".tar.gz", dir=self.incoming)
        os.close(fd)
        fetched = Path(name)
        try:
            try:
                self.storage.get_file(key, fetched)
            except StorageError as exc:
                raise ServiceUnavailableError(f"the object store did not answer: {exc}") from exc
            extract_model_archive(fetched, dest, max_unpacked_bytes=max_unpacked_bytes)
        finally:
            fetched.unlink(missing_ok=True)

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


def object_present(storage: ObjectStorage, key: str, size: int | None = None) -> bool:
    """Whether the store holds ``key`` (of ``size`` bytes, when given); 503 when it does not answer."""
    local = storage.local_path(key)
    if local is not None:
        return local.is_file() and (size is None or local.stat().st_size == size)
    try:
        found = storage.head(key)
    except StorageError as exc:
        raise ServiceUnavailableError(f"the object store did not answer: {exc}") from exc
    return found is not None and (size is None or found.size == size)


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
    """Store a checked upload and record it on the job, under the lease; commits. With file
    storage the file is renamed into ``models/<job id>.tar.gz``; with object storage it
    becomes an object of its own (``jobs.model_key``), the previous one removed after."""
    job, placement = lock_lease(session, principal, lease_token, job_id=job_id)
    _check_uploader(job, placement.node_rank)
    previous = store.key(job_id, job.model_key) if job.model_sha256 is not None else None
    key = store.new_key(job_id)
    job.model_sha256 = sha256
    job.model_size = incoming.size
    job.model_key = key if store.storage.direct else None
    job.updated_at = utcnow()
    session.flush()
    store.storage.adopt_file(key, incoming.path)
    session.commit()
    store.drop_replaced(job_id, previous, key)
    log.info("job %s: model archive stored (%d bytes, sha256 %s)", job_id, incoming.size, sha256)
    return job


def publish_direct_model(
    session: Session,
    principal: Principal,
    store: ModelStore,
    job_id: str,
    lease_token: str | None,
    upload: ObjectUpload,
) -> Job:
    """Record an archive node rank 0 PUT to the object store (a completed direct upload, its
    object verified by the store) as the job's model, under the lease, in the transaction
    that drops the upload's row; the previous object is removed after. Commits."""
    job, placement = lock_lease(session, principal, lease_token, job_id=job_id)
    _check_uploader(job, placement.node_rank)
    previous = store.key(job_id, job.model_key) if job.model_sha256 is not None else None
    job.model_sha256 = upload.sha256
    job.model_size = upload.size_bytes
    job.model_key = upload.key
    job.updated_at = utcnow()
    session.delete(upload)
    session.commit()
    store.drop_replaced(job_id, previous, job.model_key)
    log.info(
        "job %s: model archive stored by direct upload (%d bytes, sha256 %s)",
        job_id,
        job.model_size,
        job.model_sha256,
    )
    return job


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ModelFile:
    path: Path | None  # where objects are files; None in object storage
    sha256: str
    size: int
    filename: str
    key: str = ""


def _download_name(job: Job) -> str:
    return f"{job.name}-{job.id}.tar.gz"


def _model_file(store: ModelStore, job: Job) -> ModelFile:
    if job.status != JobStatus.SUCCEEDED or job.model_sha256 is None:
        raise ModelNotReadyError(
            f"job {job.id} is {job.status}: its model directory is available once it has succeeded"
        )
    key = store.key(job.id, job.model_key)
    if not object_present(store.storage, key):
        raise NotFoundError(f"the model archive of job {job.id} is missing from the artifact store")
    return ModelFile(
        path=store.storage.local_path(key),
        sha256=job.model_sha256,
        size=job.model_size or 0,
        filename=_download_name(job),
        key=key,
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
