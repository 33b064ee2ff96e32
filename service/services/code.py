"""Code packages for script jobs: upload, listing, deletion and shipping to workers (no HTTP).

An upload goes through the same safe extractor as a dataset (size and file caps, no
traversal, links or devices). The files are stored content-addressed under
``<data dir>/code/<sha256>/`` (``sha256`` is the manifest checksum datasets use), so two
uploads of the same folder share one copy. Hidden files and folders (``.git``,
``.env``...) are not part of a package. A package is its owner's only.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Literal

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.datasets import staging
from service.datasets.manifest import check_code_manifest
from service.datasets.tarstream import DatasetTar
from service.db.models import CodePackage, Job, Node, ObjectUpload, Placement
from service.db.types import utcnow
from service.schemas.code import CodeUploadRequest
from service.services import direct_uploads, refs
from service.services.leases import speaks_for
from service.services.ownership import first_team
from service.services.stored_archives import archive_suffix, delete_object
from service.services.tokens import Principal
from service.states import ACTIVE_STATUSES, PlacementStatus
from service.storage import ObjectStorage
from torchyard.contract.archive import ExtractionLimits, detect_format, extract_archive
from torchyard.contract.dataset_digest import drop_ignored, hash_files, list_files, manifest_sha256
from torchyard.contract.errors import (
    ConflictError,
    InvalidCodeError,
    InvalidDatasetError,
    NotFoundError,
    PermissionDeniedError,
)
from torchyard.contract.files import locked
from torchyard.contract.responses import CodePublic
from torchyard.contract.transfer import UploadPlan

log = logging.getLogger(__name__)

# An archive of source files may expand to this many times the upload limit.
EXPANSION = 4


def code_dir(settings: Settings) -> Path:
    return settings.data_dir / "code"


def staging_dir(settings: Settings) -> Path:
    return code_dir(settings) / ".staging"


def upload_workspace(settings: Settings, principal: Principal) -> AbstractContextManager[Path]:
    """A private folder for one upload (see :func:`service.datasets.staging.workspace`)."""
    return staging.workspace(
        staging_dir(settings),
        owner=principal.id,
        max_per_owner=settings.max_concurrent_uploads_per_user,
        what="code",
    )


@contextmanager
def _store_lock(settings: Settings) -> Iterator[None]:
    store = code_dir(settings)
    store.mkdir(parents=True, exist_ok=True)
    with locked(store / ".lock"):
        yield


def create_from_archive(
    session: Session, settings: Settings, principal: Principal, name: str, archive: Path, workspace: Path
) -> CodePackage:
    """Extract an uploaded archive safely, store its files and record the package.

    Raises InvalidCodeError (422) with nothing left behind. The caller removes ``archive``."""
    limits = ExtractionLimits(
        max_bytes=settings.max_code_upload_bytes * EXPANSION,
        max_files=settings.max_code_files,
        max_ratio=settings.max_compression_ratio,
    )
    try:
        extracted = extract_archive(archive, workspace, limits)
    except InvalidDatasetError as exc:
        raise InvalidCodeError(str(exc).replace("dataset", "code package"), details=exc.details) from None
    try:
        try:
            files = list_files(extracted)
        except InvalidDatasetError as exc:
            raise InvalidCodeError(str(exc), details=exc.details) from None
        if not files:
            raise InvalidCodeError("the archive holds no files (hidden files are not part of a package)")
        drop_ignored(extracted)
        digests = hash_files(extracted, files)
        sha = manifest_sha256(digests.items())
        size = sum((extracted / rel).stat().st_size for rel in files)
        final = code_dir(settings) / sha
        storage = direct_uploads.storage_of(settings)
        with _store_lock(settings):
            row = CodePackage(
                owner_id=principal.id,
                team_id=first_team(principal),
                name=name,
                sha256=sha,
                size_bytes=size,
                files=len(files),
                created_at=utcnow(),
            )
            if storage.direct:
                # Object storage: the checked archive itself is kept (shared by content).
                key = _checked_archive(session, sha)
                if key is None:
                    key = f"code/{sha}.{detect_format(archive)}"
                    storage.adopt_file(key, archive)
                row.archive_key = key
            elif not final.exists():
                os.rename(extracted, final)
            session.add(row)
            session.commit()
    finally:
        shutil.rmtree(extracted, ignore_errors=True)
    log.info("code package %s (%r) uploaded: %d files, sha256 %s", row.id, name, row.files, sha)
    return row


def _checked_archive(session: Session, sha: str) -> str | None:
    """The object key of a visible package of content ``sha`` whose archive the API itself
    checked (``code/<sha256>.<format>``), if any: only those are shared (a direct upload's
    archive is its manifest's content only as far as its client says)."""
    found: str | None = session.scalars(
        select(CodePackage.archive_key)
        .where(
            CodePackage.sha256 == sha,
            CodePackage.deleted_at.is_(None),
            CodePackage.archive_key.like(f"code/{sha}.%"),
        )
        .limit(1)
    ).first()
    return found


_DIRECT_KIND = "code"


def plan_direct_upload(
    session: Session,
    settings: Settings,
    storage: ObjectStorage,
    principal: Principal,
    body: CodeUploadRequest,
) -> UploadPlan:
    """Object storage: check the client's manifest (422 InvalidCodeError, nothing recorded),
    then plan the archive's direct upload (docs/storage.md)."""
    manifest = body.manifest
    check_code_manifest(
        manifest, max_files=settings.max_code_files, max_bytes=settings.max_code_upload_bytes * EXPANSION
    )
    suffix = archive_suffix(body.filename)
    details = {
        "name": body.name,
        "sha256": manifest.sha256,
        "files": manifest.num_files,
        "size_bytes": manifest.size_bytes,
    }
    return direct_uploads.plan_upload(
        session,
        storage,
        settings,
        body,
        kind=_DIRECT_KIND,
        owner_id=principal.id,
        key_for=lambda upload_id: f"code/{manifest.sha256}/{upload_id}.{suffix}",
        complete_url=lambda upload_id: f"/v1/code/uploads/{upload_id}",
        limit=settings.max_code_upload_bytes,
        what="the code archive",
        details=details,
    )


def complete_direct_upload(
    session: Session, settings: Settings, storage: ObjectStorage, principal: Principal, upload_id: str
) -> CodePackage:
    """Record the package of a completed direct upload (409 while parts are missing); every
    node that fetches its archive recomputes the checksum and refuses another content."""
    upload = direct_uploads.find_upload(session, upload_id, kind=_DIRECT_KIND, owners=principal.owners)
    direct_uploads.take_upload(session, storage, upload)
    session.commit()
    d = upload.details
    with _store_lock(settings):
        existing = _checked_archive(session, str(d["sha256"]))
        row = CodePackage(
            owner_id=principal.id,
            team_id=first_team(principal),
            name=str(d["name"]),
            sha256=str(d["sha256"]),
            size_bytes=int(d["size_bytes"]),
            files=int(d["files"]),
            archive_key=existing or upload.key,
            created_at=utcnow(),
        )
        session.add(row)
        upload_row = session.get(ObjectUpload, upload_id)
        if upload_row is not None:
            session.delete(upload_row)
        session.commit()
    if existing is not None:
        delete_object(storage, upload.key)
    log.info("code package %s (%r) uploaded to the object store: %d files", row.id, row.name, row.files)
    return row


def get_code(
    session: Session,
    principal: Principal,
    code_id: str,
    *,
    exact: bool = False,
    lock: Literal["share", "update"] | None = None,
) -> CodePackage:
    """The package, if the principal may see it; another user's (or a deleted) one is a 404.

    Unless ``exact``, ``code_id`` may also be its name or a unique prefix of its id. ``lock``
    holds its row until the transaction ends (``"share"`` for a job submission, ``"update"``
    for a deletion on PostgreSQL), so that the two cannot interleave: a submission waits for
    a deletion in progress (and then finds no package), a deletion for a submission (and then
    finds the job using it)."""
    not_found = NotFoundError(f"code package {code_id!r} not found", details={"field": "code"})
    return refs.find_owned(
        session, principal, CodePackage, code_id, exact=exact, not_found=not_found, lock=lock
    )


def list_code(
    session: Session, principal: Principal, *, limit: int, cursor: str | None
) -> tuple[list[CodePackage], str | None]:
    """Newest first; ``cursor`` continues after the last package of the previous page."""
    return refs.page_owned(session, principal, CodePackage, limit=limit, cursor=cursor)


def code_public(row: CodePackage) -> CodePublic:
    return CodePublic(
        id=row.id,
        name=row.name,
        owner=row.owner_id,
        sha256=row.sha256,
        size_bytes=row.size_bytes,
        files=row.files,
        created_at=row.created_at,
    )


def delete_code(session: Session, settings: Settings, principal: Principal, code_id: str) -> None:
    """Delete a package no queued or running job uses (409 otherwise)."""
    row = get_code(session, principal, code_id, lock="update")
    users = session.execute(
        select(Job.id, Job.status)
        .where(Job.code_id == row.id, Job.status.in_(ACTIVE_STATUSES))
        .order_by(Job.created_at)
        .limit(20)
    ).all()
    if users:
        listed = ", ".join(f"{job_id} ({status})" for job_id, status in users)
        raise ConflictError(
            f"code package {row.id!r} is used by jobs that have not finished: {listed}; "
            "cancel them or wait for them to finish",
            details={"jobs": [job_id for job_id, _ in users]},
        )
    row.deleted_at = utcnow()
    sha, key = row.sha256, row.archive_key
    session.commit()
    log.info("code package %s deleted by %s", row.id, principal.name)
    if key is not None:
        with _store_lock(settings):
            users = session.scalar(
                select(func.count())
                .select_from(CodePackage)
                .where(CodePackage.archive_key == key, CodePackage.deleted_at.is_(None))
            )
            session.commit()
            if not users:
                delete_object(direct_uploads.storage_of(settings), key)
        return
    with _store_lock(settings):
        left = session.scalar(
            select(func.count())
            .select_from(CodePackage)
            .where(
                CodePackage.sha256 == sha, CodePackage.deleted_at.is_(None), CodePackage.archive_key.is_(None)
            )
        )
        session.commit()
        target = code_dir(settings) / sha
        if left or not target.exists():
            return
        trash = staging_dir(settings) / f"deleted-{uuid.uuid4().hex}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        os.rename(target, trash)
    shutil.rmtree(trash, ignore_errors=True)


def code_for_worker(session: Session, principal: Principal, code_id: str) -> CodePackage:
    """The package a worker asks for, if a job placed on one of its nodes uses it."""
    row = session.get(CodePackage, code_id)
    if row is None:
        raise NotFoundError(f"code package {code_id!r} not found")
    placed = session.scalars(
        select(Placement.id)
        .join(Node, Node.id == Placement.node_id)
        .join(Job, Job.id == Placement.job_id)
        .where(
            speaks_for(principal),
            Placement.status != PlacementStatus.DONE,
            Job.code_id == row.id,
        )
        .limit(1)
    ).first()
    if placed is None:
        raise PermissionDeniedError(
            f"code package {code_id!r} is not used by any job placed on this worker's nodes"
        )
    return row


def code_tar(settings: Settings, row: CodePackage) -> DatasetTar:
    """The deterministic tar of a package's files (what workers download and verify)."""
    root = code_dir(settings) / row.sha256
    if not root.is_dir():
        raise NotFoundError(f"the files of code package {row.id!r} are missing from the store")
    return DatasetTar(root, list_files(root))
