"""``torchyard storage migrate`` (docs/storage.md): copy a data directory's artifacts into an
object store, verified, resumable, and switching nothing until every one is there.

What is copied, each to the key it has in object storage:

* checkpoints of live jobs (``checkpoints/<job>/<id>.pt``), model and outputs archives of
  jobs (``models/<job>.tar.gz``, ``outputs/<job>.tar.gz`` and ``outputs/<job>/node-<n>.tar.gz``),
  pretrained weights (``weights/<sha256>.pth``): the files as they are;
* uploaded datasets and code packages, which the data directory keeps as folders: the
  deterministic tar agents are sent (``datasets/<sha256>.tar``, ``code/<sha256>.tar``).

Each object is sent in presigned parts whose sha256 the store verifies (the same path as a
client's direct upload) and completed only when whole; one the store already holds with the
same size and checksum is skipped, so a second run copies only what is new or was cut short.
Nothing changes in the database until every artifact is in the store; then, in one
transaction, the datasets and code packages are pointed at their archives. Serving from
the bucket starts only when the operator sets ``TORCHYARD_STORAGE_URL`` and restarts.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.engine import Database
from service.db.models import Checkpoint, CodePackage, Dataset, Job, PretrainedWeights
from service.services import code as code_service
from service.services import datasets as dataset_service
from service.storage.base import ObjectStorage, StorageError, UploadIncomplete
from torchyard.contract.errors import NotFoundError
from torchyard.contract.transfer import PART_BYTES, describe_file

log = logging.getLogger(__name__)

_TTL_S = 3600


@dataclass
class Artifact:
    key: str
    what: str
    source: Path | None = None  # a file as it is
    build: Callable[[Path], None] | None = None  # or one written on demand (a folder's tar)
    row: tuple[type[Dataset] | type[CodePackage], str] | None = None  # archive_key to set


@dataclass
class MigrationReport:
    copied: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    bytes_sent: int = 0

    @property
    def complete(self) -> bool:
        return not self.failed


def _write_tar(make: Callable[[], Iterable[bytes]]) -> Callable[[Path], None]:
    def build(dest: Path) -> None:
        with open(dest, "wb") as out:
            for chunk in make():
                out.write(chunk)

    return build


def artifacts(db: Database, settings: Settings) -> list[Artifact]:
    """Every artifact the data directory holds that the database knows of."""
    with db.read_session() as session:
        return _files(session, settings.data_dir) + _folders(session, settings)


def _files(session: Session, data: Path) -> list[Artifact]:
    found: list[Artifact] = []
    for row in session.scalars(select(Checkpoint).order_by(Checkpoint.job_id, Checkpoint.id)):
        key = f"checkpoints/{row.job_id}/{row.id}.pt"
        found.append(Artifact(key, f"checkpoint {row.id} of job {row.job_id}", data / key))
    jobs = session.scalars(
        select(Job)
        .where(Job.deleted_at.is_(None))
        .where(
            (Job.model_sha256.is_not(None) & Job.model_key.is_(None))
            | (Job.outputs_sha256.is_not(None) & Job.outputs_key.is_(None))
        )
    ).all()
    for job in jobs:
        if job.model_sha256 is not None and job.model_key is None:
            key = f"models/{job.id}.tar.gz"
            found.append(Artifact(key, f"model of job {job.id}", data / key))
        if job.outputs_sha256 is not None and job.outputs_key is None:
            key = f"outputs/{job.id}.tar.gz"
            found.append(Artifact(key, f"outputs of job {job.id}", data / key))
            for node in sorted((data / "outputs" / job.id).glob("node-*.tar.gz")):
                node_key = f"outputs/{job.id}/{node.name}"
                found.append(Artifact(node_key, f"outputs of job {job.id} ({node.name})", node))
    for weights in session.scalars(select(PretrainedWeights).order_by(PretrainedWeights.id)):
        key = f"weights/{weights.sha256}.pth"
        found.append(Artifact(key, f"weights {weights.id}", data / key))
    return found


def _folders(session: Session, settings: Settings) -> list[Artifact]:
    found: list[Artifact] = []
    seen: set[str] = set()
    datasets = session.scalars(
        select(Dataset).where(
            Dataset.deleted_at.is_(None), Dataset.source == "upload", Dataset.archive_key.is_(None)
        )
    ).all()
    for dataset in datasets:
        key = f"datasets/{dataset.sha256}.tar"
        if key not in seen:
            seen.add(key)
            tar = partial(dataset_service.dataset_tar, settings, dataset)
            found.append(Artifact(key, f"dataset {dataset.id}", build=_write_tar(tar)))
        found.append(Artifact(key, f"dataset {dataset.id}", row=(Dataset, dataset.id)))
    packages = session.scalars(
        select(CodePackage).where(CodePackage.deleted_at.is_(None), CodePackage.archive_key.is_(None))
    ).all()
    for package in packages:
        key = f"code/{package.sha256}.tar"
        if key not in seen:
            seen.add(key)
            tar = partial(code_service.code_tar, settings, package)
            found.append(Artifact(key, f"code package {package.id}", build=_write_tar(tar)))
        found.append(Artifact(key, f"code package {package.id}", row=(CodePackage, package.id)))
    return found


def _send(storage: ObjectStorage, client: httpx.Client, key: str, path: Path) -> int:
    request = describe_file(path, PART_BYTES)
    plan = {
        "sha256": request.sha256,
        "size": request.size,
        "part_bytes": request.part_bytes,
        "part_sha256": request.part_sha256,
    }
    if storage.holds(key, **plan):  # type: ignore[arg-type]
        return -1
    targets = storage.begin_upload(key, ttl_s=_TTL_S, **plan)  # type: ignore[arg-type]
    sent = 0
    try:
        with open(path, "rb") as fh:
            for part in targets.parts:
                body = fh.read(part.size)
                response = client.put(part.url, content=body, headers=part.headers)
                if response.status_code >= 300:
                    raise UploadIncomplete(
                        f"part {part.number}: HTTP {response.status_code} {response.text[:200]}"
                    )
                sent += len(body)
        storage.finish_upload(key, targets.upload_id, **plan)  # type: ignore[arg-type]
    except BaseException:
        storage.abort_upload(key, targets.upload_id)
        raise
    return sent


def migrate(
    db: Database, settings: Settings, storage: ObjectStorage, *, progress: Callable[[str], None] = log.info
) -> MigrationReport:
    """Copy every artifact into ``storage`` (see the module's docstring)."""
    report = MigrationReport()
    pointers: list[tuple[type[Dataset] | type[CodePackage], str, str]] = []
    with httpx.Client(timeout=httpx.Timeout(60.0, read=900.0, write=900.0)) as client:
        for artifact in artifacts(db, settings):
            if artifact.row is not None:
                pointers.append((artifact.row[0], artifact.row[1], artifact.key))
                continue
            try:
                sent = _copy(storage, client, artifact)
            except (FileNotFoundError, NotFoundError):
                report.missing.append(artifact.key)
                progress(f"missing   {artifact.key} ({artifact.what}): not in the data directory")
                continue
            except (StorageError, UploadIncomplete, httpx.HTTPError, OSError) as exc:
                report.failed.append((artifact.key, str(exc)))
                progress(f"FAILED    {artifact.key}: {exc}")
                continue
            if sent < 0:
                report.skipped.append(artifact.key)
                progress(f"present   {artifact.key}")
            else:
                report.copied.append(artifact.key)
                report.bytes_sent += sent
                progress(f"copied    {artifact.key} ({sent} bytes)")
    there = set(report.copied) | set(report.skipped)
    if report.complete and pointers:
        with db.session() as session:
            for model, row_id, key in pointers:
                if key not in there:
                    continue
                session.execute(update(model).where(model.id == row_id).values(archive_key=key))
            session.commit()
    return report


def _copy(storage: ObjectStorage, client: httpx.Client, artifact: Artifact) -> int:
    if artifact.source is not None:
        if not artifact.source.exists():
            raise FileNotFoundError(artifact.source)
        return _send(storage, client, artifact.key, artifact.source)
    assert artifact.build is not None
    with tempfile.TemporaryDirectory(prefix="torchyard-migrate-") as tmp:
        built = Path(tmp) / "archive.tar"
        artifact.build(built)
        return _send(storage, client, artifact.key, built)
