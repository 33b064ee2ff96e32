"""Deleting a finished job: its metrics, logs, history, attempts, checkpoints and files.

The job's row stays, marked ``deleted_at`` and hidden everywhere (as a deleted dataset's
is), so that its id is never given again and the rows that name it (a soft-deleted model
version, a job fine-tuned from it) stay valid. Everything that takes room goes: the
metric points, log chunks, status history, attempts with their placements, checkpoints,
the job's objects in the artifact store (model archives, a script job's outputs,
checkpoints: docs/storage.md) and its files under the data directory (the model's
unpacked copy, single output files served).

The metric points and log chunks, which can be many (a job keeps up to
``TORCHYARD_MAX_METRIC_POINTS_PER_JOB`` points), go first, at most :data:`DELETE_BATCH_ROWS`
points or :data:`DELETE_BATCH_LOG_CHUNKS` log chunks per transaction, each committed, so
that another writer (SQLite has one at a time) never waits for more than one batch. The
job is marked deleted with the rest in a last transaction, which checks again that it may
be; a delete interrupted half-way leaves the job there, with what was not yet removed,
and is simply asked again.

A job that has not ended is refused (409: cancel it first), and so is one whose model is
registered as a live model version (409 naming the versions: the registry serves the
model from the job's files, so delete the versions first or keep the job), and one a
queued or running job fine-tunes from.

``retention_s`` in the settings removes finished jobs the same way once they have been
finished that long (the reaper's pass); those that would be refused are kept.
"""

from __future__ import annotations

import logging
import shutil
from datetime import timedelta
from pathlib import Path

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.engine import Database
from service.db.models import Attempt, Checkpoint, Job, JobEvent, LogChunk, Metric, ModelVersion
from service.db.types import utcnow
from service.services.artifacts import ModelStore
from service.services.checkpoints import CheckpointStore
from service.services.direct_uploads import storage_of
from service.services.job_lookup import get_job
from service.services.outputs import OutputsStore
from service.services.tokens import Principal
from service.states import FINAL_STATUSES
from service.storage import ObjectStorage
from service.storage.base import StorageError
from torchyard.contract.errors import ConflictError

log = logging.getLogger(__name__)

# Finished jobs removed by one retention pass at most (the next pass goes on).
RETENTION_BATCH = 20
# Rows deleted per transaction: metric points (small rows), and log chunks (up to 256 KiB each).
DELETE_BATCH_ROWS = 10_000
DELETE_BATCH_LOG_CHUNKS = 1_000


def blockers(session: Session, job: Job) -> ConflictError | None:
    """Why ``job`` cannot be deleted now (a 409 to raise), or None."""
    if not job.status.is_final():
        return ConflictError(
            f"job {job.id} is {job.status}: only a finished job can be deleted; cancel it first "
            f"(torchyard cancel {job.id} --wait)",
            details={"status": job.status},
        )
    versions = list(
        session.scalars(
            select(ModelVersion)
            .where(ModelVersion.job_id == job.id, ModelVersion.deleted_at.is_(None))
            .order_by(ModelVersion.name, ModelVersion.version)
        )
    )
    if versions:
        named = [f"{v.name}:{v.version}" for v in versions]
        return ConflictError(
            f"job {job.id}'s model is registered as {', '.join(named)}: the registry serves it from "
            f"this job's files; delete those versions first (torchyard model delete {named[0]}) "
            "or keep the job",
            details={"model_versions": named},
        )
    children = list(
        session.scalars(
            select(Job.id).where(
                Job.init_from_job_id == job.id, Job.status.not_in(FINAL_STATUSES), Job.deleted_at.is_(None)
            )
        )
    )
    if children:
        return ConflictError(
            f"job {job.id}'s model initialises the unfinished job(s) {', '.join(children)}",
            details={"jobs": children},
        )
    return None


def _delete_in_batches(session: Session, job_id: str) -> None:
    """Delete the job's metric points and log chunks a batch per transaction, committing
    each (the session holds nothing once this returns)."""
    for table, batch in ((Metric, DELETE_BATCH_ROWS), (LogChunk, DELETE_BATCH_LOG_CHUNKS)):
        while True:
            chosen = select(table.seq).where(table.job_id == job_id).limit(batch)
            result = session.execute(
                delete(table).where(table.seq.in_(chosen.scalar_subquery())),
                execution_options={"synchronize_session": False},
            )
            session.commit()
            if result.rowcount < batch:  # type: ignore[attr-defined]
                break


def _forget(session: Session, job: Job) -> None:
    """Remove the job's rows (all but its own, which is marked deleted); what is left of
    its points and log chunks after :func:`_delete_in_batches` (nothing, or a few)."""
    for table in (Metric, LogChunk, Checkpoint, JobEvent):
        session.execute(delete(table).where(table.job_id == job.id))
    session.execute(delete(Attempt).where(Attempt.job_id == job.id))  # placements cascade
    now = utcnow()
    job.deleted_at = now
    job.updated_at = now


def remove_files(data_dir: Path, job_id: str, storage: ObjectStorage | None = None) -> None:
    """Every object and file the service keeps for the job (missing ones are fine): with
    object storage, every object of the job's keys (``models/<job id>.tar.gz`` and
    ``models/<job id>/``, the same for ``outputs/``, and ``checkpoints/<job id>/``); then
    the files under the data directory (the whole layout with file storage, local copies
    with object storage). An object the store fails to remove is logged (the job is
    deleted all the same)."""
    if storage is not None and storage.direct:
        try:
            for kind in ("models", "outputs"):
                storage.delete(f"{kind}/{job_id}.tar.gz")
                storage.delete_prefix(f"{kind}/{job_id}/")
            storage.delete_prefix(f"checkpoints/{job_id}/")
        except StorageError as exc:
            log.error("job %s: its objects could not all be removed from the store: %s", job_id, exc)
    models = ModelStore(data_dir)
    outputs = OutputsStore(data_dir)
    paths = [
        models.path(job_id),
        outputs.archive(job_id),
        outputs.root / job_id,
        outputs.files_dir(job_id),
        outputs.root / f".{job_id}.lock",
        CheckpointStore(data_dir).job_dir(job_id),
        *(models.root / "unpacked").glob(f"{job_id}-*"),
    ]
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def delete_job(session: Session, settings: Settings, principal: Principal, job_ref: str) -> Job:
    """Delete the principal's finished job (see the module's docstring); the job as it was."""
    job = get_job(session, principal, job_ref, for_update=True, write=True)
    refused = blockers(session, job)
    if refused is not None:
        raise refused
    job_id = job.id
    session.commit()
    _delete_in_batches(session, job_id)
    job = get_job(session, principal, job_id, for_update=True, write=True)
    refused = blockers(session, job)  # again: something may have started using it meanwhile
    if refused is not None:
        raise refused
    _forget(session, job)
    session.commit()
    remove_files(settings.data_dir, job.id, storage_of(settings))
    log.info("job %s deleted by %s", job.id, principal.name)
    return job


def apply_retention(db: Database, settings: Settings) -> int:
    """Delete up to :data:`RETENTION_BATCH` jobs finished more than ``retention_s`` ago;
    how many. Jobs whose delete would be refused are left as they are."""
    if settings.retention_s is None:
        return 0
    cutoff = utcnow() - timedelta(seconds=settings.retention_s)
    with db.read_session() as session:
        candidates = list(
            session.scalars(
                select(Job.id)
                .where(
                    Job.deleted_at.is_(None),
                    Job.status.in_(FINAL_STATUSES),
                    Job.finished_at < cutoff,
                    Job.id.not_in(select(ModelVersion.job_id).where(ModelVersion.deleted_at.is_(None))),
                )
                .order_by(Job.finished_at)
                .limit(RETENTION_BATCH * 5)
            )
        )
    removed = 0
    for job_id in candidates:
        if removed >= RETENTION_BATCH:
            break
        if not _retire(db, job_id):
            continue
        remove_files(settings.data_dir, job_id, storage_of(settings))
        removed += 1
        log.info("job %s deleted: finished more than %.0f s ago (retention)", job_id, settings.retention_s)
    return removed


def _deletable(session: Session, job_id: str) -> Job | None:
    """The job, locked, unless it is gone or may not be deleted now."""
    job = session.scalars(
        select(Job).where(Job.id == job_id, Job.deleted_at.is_(None)).with_for_update()
    ).first()
    if job is None or blockers(session, job) is not None:
        return None
    return job


def _retire(db: Database, job_id: str) -> bool:
    """Delete a job the retention pass found, unless it is gone or may not be deleted
    (checked before the batches and again in the last transaction); whether it was."""
    with db.session() as session:
        if _deletable(session, job_id) is None:
            return False
        session.commit()
        _delete_in_batches(session, job_id)
        job = _deletable(session, job_id)
        if job is None:
            session.rollback()
            return False
        _forget(session, job)
        session.commit()
        return True
