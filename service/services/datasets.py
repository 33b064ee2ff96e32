"""Datasets: creation from uploaded archives and registered folders, listing, deletion,
shipping to workers, and the label checks made at job submission (no HTTP here).

Uploaded datasets are stored immutably and content-addressed under
``<data dir>/datasets/<sha256>/`` (the folder holding the class folders); two uploads of
the same content share one copy. Folders registered by path stay where they are.

Deleting a dataset hides its row (finished jobs keep referring to it) and removes the
stored copy once no visible dataset uses it. Placing a copy and releasing one happen
under one file lock (``datasets/.lock``), so a concurrent upload of the same content
never sees its copy removed by a deletion.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Literal

from sqlalchemy import bindparam, func, or_, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.datasets import staging
from service.datasets.manifest import check_dataset_manifest
from service.datasets.tarstream import DatasetTar
from service.datasets.validate import ValidatedDataset, validate_image_directory
from service.db.models import Dataset, Job, JobInput, Node, ObjectUpload, Placement
from service.db.types import utcnow
from service.schemas.datasets import DatasetRegister, DatasetUploadRequest
from service.services import direct_uploads, refs
from service.services.leases import speaks_for
from service.services.ownership import first_team
from service.services.stored_archives import archive_suffix, delete_object
from service.services.tokens import Principal
from service.states import ACTIVE_STATUSES, PlacementStatus
from service.storage import ObjectStorage
from torchyard.contract.archive import ExtractionLimits, detect_format, extract_archive
from torchyard.contract.dataset_digest import list_files
from torchyard.contract.errors import (
    ConflictError,
    InvalidDatasetError,
    NotFoundError,
    PermissionDeniedError,
    RequestValidationError,
)
from torchyard.contract.files import locked
from torchyard.contract.responses import DatasetPublic
from torchyard.contract.transfer import UploadPlan

log = logging.getLogger(__name__)

SOURCE_UPLOAD = "upload"
SOURCE_PATH = "path"


# ---------------------------------------------------------------------------- storage layout


def datasets_dir(settings: Settings) -> Path:
    return settings.data_dir / "datasets"


def staging_dir(settings: Settings) -> Path:
    """Where uploads land and archives are extracted: on the same file system as the
    store, so that a validated dataset is moved into place with one rename."""
    return datasets_dir(settings) / ".staging"


def upload_workspace(settings: Settings, principal: Principal) -> AbstractContextManager[Path]:
    """A private, empty folder in the staging area for one upload and its extraction,
    removed when the block ends. 409 ConflictError when the user already has
    ``max_concurrent_uploads_per_user`` uploads in progress."""
    return staging.workspace(
        staging_dir(settings), owner=principal.id, max_per_owner=settings.max_concurrent_uploads_per_user
    )


async def clean_staging_periodically(settings: Settings, stop: asyncio.Event) -> None:
    """Remove what interrupted uploads left in the staging area: at once (a process that
    was killed left its uploads' folders behind), then every ``staging_sweep_interval_s``.
    Folders in use by an upload, of this process or another, are kept. Code packages'
    uploads are staged the same way and cleaned with them."""
    from service.services.code import staging_dir as code_staging_dir

    folders = [staging_dir(settings), code_staging_dir(settings)]
    await staging.remove_interrupted_periodically(folders, settings.staging_sweep_interval_s, stop)


def data_root(settings: Settings, dataset: Dataset) -> Path:
    """The folder holding the dataset's class folders."""
    path = Path(dataset.storage_path)
    return path if path.is_absolute() else settings.data_dir / path


def allowed_roots(settings: Settings) -> list[Path]:
    return [Path(root).resolve() for root in settings.dataset_roots]


@contextmanager
def _store_lock(settings: Settings) -> Iterator[None]:
    store = datasets_dir(settings)
    store.mkdir(parents=True, exist_ok=True)
    with locked(store / ".lock"):
        yield


# ---------------------------------------------------------------------------- creation


def _new_row(principal: Principal, name: str, source: str, storage: str, v: ValidatedDataset) -> Dataset:
    return Dataset(
        owner_id=principal.id,
        team_id=first_team(principal),
        name=name,
        source=source,
        storage_path=storage,
        classes=v.classes,
        class_counts=v.class_counts,
        num_images=v.num_images,
        size_bytes=v.size_bytes,
        sha256=v.sha256,
        created_at=utcnow(),
    )


def create_from_archive(
    session: Session,
    settings: Settings,
    principal: Principal,
    name: str,
    archive: Path,
    workspace: Path | None = None,
) -> Dataset:
    """Extract, validate and store an uploaded archive; record the dataset.

    The archive is extracted into ``workspace`` (from :func:`upload_workspace`), or into
    a folder of its own in the staging area. Raises InvalidDatasetError /
    NotLabeledDatasetError with nothing left behind. The caller removes ``archive``.
    """
    if workspace is None:
        with staging.workspace(staging_dir(settings)) as own:
            return create_from_archive(session, settings, principal, name, archive, own)
    limits = ExtractionLimits(
        max_bytes=settings.max_extracted_bytes,
        max_files=settings.max_extracted_files,
        max_ratio=settings.max_compression_ratio,
    )
    extracted = extract_archive(archive, workspace, limits)
    storage = direct_uploads.storage_of(settings)
    try:
        v = validate_image_directory(
            extracted, max_pixels=settings.max_image_pixels, max_files=settings.max_extracted_files
        )
        if storage.direct:
            row = _keep_archive(session, settings, storage, principal, name, archive, v)
        else:
            final = datasets_dir(settings) / v.sha256
            with _store_lock(settings):
                if final.exists():
                    log.info("dataset content %s already stored; reusing it", v.sha256)
                else:
                    os.rename(v.data_root, final)
                row = _new_row(principal, name, SOURCE_UPLOAD, f"datasets/{v.sha256}", v)
                session.add(row)
                session.commit()
    finally:
        shutil.rmtree(extracted, ignore_errors=True)
    log.info("dataset %s (%r) uploaded: %d images, sha256 %s", row.id, name, row.num_images, row.sha256)
    return row


def _checked_archive(session: Session, sha: str) -> str | None:
    """The object key of a visible dataset of content ``sha`` whose archive the API itself
    checked (received by ``POST /v1/datasets``: ``datasets/<sha256>.<format>``), if any.
    Only those are shared: a direct upload's archive is its manifest's content only as far
    as its client says, and another upload of that content must not depend on it."""
    found: str | None = session.scalars(
        select(Dataset.archive_key)
        .where(
            Dataset.sha256 == sha,
            Dataset.source == SOURCE_UPLOAD,
            Dataset.deleted_at.is_(None),
            Dataset.archive_key.like(f"datasets/{sha}.%"),
        )
        .limit(1)
    ).first()
    return found


def _keep_archive(
    session: Session,
    settings: Settings,
    storage: ObjectStorage,
    principal: Principal,
    name: str,
    archive: Path,
    v: ValidatedDataset,
) -> Dataset:
    """Object storage: the validated upload's archive becomes the object
    ``datasets/<sha256>.<format>`` (the content already kept as an archive is reused)."""
    with _store_lock(settings):
        key = _checked_archive(session, v.sha256)
        if key is None:
            key = f"datasets/{v.sha256}.{detect_format(archive)}"
            storage.adopt_file(key, archive)
        else:
            log.info("dataset content %s already stored as %s; reusing it", v.sha256, key)
        row = _new_row(principal, name, SOURCE_UPLOAD, f"datasets/{v.sha256}", v)
        row.archive_key = key
        session.add(row)
        session.commit()
    return row


_DIRECT_KIND = "dataset"


def plan_direct_upload(
    session: Session,
    settings: Settings,
    storage: ObjectStorage,
    principal: Principal,
    body: DatasetUploadRequest,
) -> UploadPlan:
    """Object storage: check the client's manifest (422 with nothing recorded when the layout
    rules or limits refuse it), then plan the archive's direct upload (docs/storage.md)."""
    manifest = body.manifest
    check_dataset_manifest(
        manifest, max_files=settings.max_extracted_files, max_bytes=settings.max_extracted_bytes
    )
    suffix = archive_suffix(body.filename)
    details = {
        "name": body.name,
        "sha256": manifest.sha256,
        "classes": manifest.classes,
        "class_counts": manifest.class_counts,
        "num_images": manifest.num_files,
        "size_bytes": manifest.size_bytes,
    }
    return direct_uploads.plan_upload(
        session,
        storage,
        settings,
        body,
        kind=_DIRECT_KIND,
        owner_id=principal.id,
        key_for=lambda upload_id: f"datasets/{manifest.sha256}/{upload_id}.{suffix}",
        complete_url=lambda upload_id: f"/v1/datasets/uploads/{upload_id}",
        limit=settings.max_upload_bytes,
        what="the dataset archive",
        details=details,
    )


def complete_direct_upload(
    session: Session, settings: Settings, storage: ObjectStorage, principal: Principal, upload_id: str
) -> Dataset:
    """Record the dataset of a completed direct upload (409 while parts are missing). The
    archive's content is the manifest's only as far as the client says: every node that
    fetches it recomputes the checksum and refuses another content (InvalidDatasetError)."""
    upload = direct_uploads.find_upload(session, upload_id, kind=_DIRECT_KIND, owners=principal.owners)
    direct_uploads.take_upload(session, storage, upload)
    session.commit()
    d = upload.details
    with _store_lock(settings):
        existing = _checked_archive(session, str(d["sha256"]))
        key = existing or upload.key
        row = Dataset(
            owner_id=principal.id,
            team_id=first_team(principal),
            name=str(d["name"]),
            source=SOURCE_UPLOAD,
            storage_path=f"datasets/{d['sha256']}",
            classes=list(d["classes"]),
            class_counts=dict(d["class_counts"]),
            num_images=int(d["num_images"]),
            size_bytes=int(d["size_bytes"]),
            sha256=str(d["sha256"]),
            archive_key=key,
            created_at=utcnow(),
        )
        session.add(row)
        upload_row = session.get(ObjectUpload, upload_id)
        if upload_row is not None:
            session.delete(upload_row)
        session.commit()
    if existing is not None:
        log.info("dataset content %s already stored as %s; dropping the new copy", row.sha256, existing)
        delete_object(storage, upload.key)
    log.info(
        "dataset %s (%r) uploaded to the object store: %d images, sha256 %s",
        row.id,
        row.name,
        row.num_images,
        row.sha256,
    )
    return row


def resolve_registered_path(settings: Settings, raw: str) -> Path:
    """The resolved folder of a registration request, if it lies under an allowed root."""
    roots = allowed_roots(settings)
    if not roots:
        raise PermissionDeniedError(
            "registering datasets by path is disabled: the operator has configured no dataset roots "
            "(TORCHYARD_DATASET_ROOTS)"
        )
    if "\x00" in raw:
        raise RequestValidationError(f"path {raw!r} holds a NUL character", details={"field": "path"})
    path = Path(raw)
    if not path.is_absolute():
        raise RequestValidationError(f"path {raw!r} must be absolute", details={"field": "path"})
    # Messages name only what the client sent, never where its links lead on this host.
    try:
        resolved = path.resolve()
    except RuntimeError:  # a symbolic link loop
        raise InvalidDatasetError(f"path {raw!r} holds a symbolic link loop") from None
    except OSError as exc:  # a link the service may not read, such as /proc/<pid>/cwd
        raise PermissionDeniedError(
            f"path {raw!r} cannot be resolved by the service ({exc.strerror or 'unreadable'})",
            details={"field": "path"},
        ) from None
    if not any(resolved == root or resolved.is_relative_to(root) for root in roots):
        raise PermissionDeniedError(
            f"path {raw!r} is outside the allowed dataset roots once links are resolved",
            details={"allowed_roots": [str(r) for r in settings.dataset_roots]},
        )
    try:
        is_dir = resolved.is_dir()
    except OSError as exc:
        raise PermissionDeniedError(
            f"path {raw!r} cannot be read by the service ({exc.strerror or 'unreadable'})"
        ) from None
    if not is_dir:
        raise InvalidDatasetError(f"path {raw!r} is not a folder")
    return resolved


def register_path(
    session: Session, settings: Settings, principal: Principal, body: DatasetRegister
) -> Dataset:
    """Validate a folder on shared storage in place and record it as a dataset."""
    folder = resolve_registered_path(settings, body.path)
    v = validate_image_directory(
        folder,
        max_pixels=settings.max_image_pixels,
        sample=body.sample,
        max_files=settings.max_extracted_files,
        link_roots=allowed_roots(settings),
    )
    row = _new_row(principal, body.name, SOURCE_PATH, str(v.data_root), v)
    session.add(row)
    session.commit()
    log.info("dataset %s (%r) registered at %s: %d images", row.id, body.name, v.data_root, row.num_images)
    return row


# ---------------------------------------------------------------------------- reading


def get_dataset(
    session: Session, principal: Principal, dataset_id: str, *, lock: bool = False, exact: bool = False
) -> Dataset:
    """The dataset, if the principal may see it; another user's (or a deleted) dataset is a 404.

    Unless ``exact``, ``dataset_id`` may also be the dataset's name or a unique prefix of
    its id, among the datasets the principal may list (see :mod:`service.services.refs`).
    ``lock`` holds the row until the transaction ends (shared lock on PostgreSQL), so that
    a job submission and a deletion of the same dataset cannot interleave.
    """
    return _visible_dataset(session, principal, dataset_id, exact=exact, lock="share" if lock else None)


def dataset_field(session: Session, principal: Principal, ref: str, field: str) -> Dataset:
    """The dataset a request body's ``field`` names (id, name or unique id prefix), its row
    share-locked; a 404 naming the field when there is none."""
    try:
        return get_dataset(session, principal, ref, lock=True)
    except NotFoundError as exc:
        raise NotFoundError(f"{field}: {exc.message}", details={"field": field}) from exc


def _visible_dataset(
    session: Session, principal: Principal, ref: str, *, exact: bool, lock: Literal["share", "update"] | None
) -> Dataset:
    """The dataset ``ref`` names for the principal, its row locked ``"share"`` or ``"update"``."""
    not_found = NotFoundError(
        f"dataset {ref!r} not found (no dataset you may see has this id, name or id prefix)"
        + refs.not_found_hint(ref)
    )
    return refs.find_owned(session, principal, Dataset, ref, exact=exact, not_found=not_found, lock=lock)


def list_datasets(
    session: Session, principal: Principal, *, limit: int, cursor: str | None
) -> tuple[list[Dataset], str | None]:
    """Newest first; ``cursor`` continues after the last dataset of the previous page."""
    return refs.page_owned(session, principal, Dataset, limit=limit, cursor=cursor)


def dataset_public(row: Dataset) -> DatasetPublic:
    return DatasetPublic(
        id=row.id,
        name=row.name,
        owner=row.owner_id,
        source="path" if row.source == SOURCE_PATH else "upload",
        path=row.storage_path if row.source == SOURCE_PATH else None,
        classes=row.classes,
        class_counts=row.class_counts,
        num_images=row.num_images,
        size_bytes=row.size_bytes,
        sha256=row.sha256,
        created_at=row.created_at,
    )


# ---------------------------------------------------------------------------- deletion


def delete_dataset(session: Session, settings: Settings, principal: Principal, dataset_id: str) -> None:
    """Delete a dataset no queued or running job uses (409 otherwise)."""
    row = _visible_dataset(session, principal, dataset_id, exact=False, lock="update")
    users = session.execute(
        select(Job.id, Job.status)
        .where(
            or_(
                Job.train_dataset_id == row.id,
                Job.validation_dataset_id == row.id,
                Job.id.in_(select(JobInput.job_id).where(JobInput.dataset_id == row.id)),
            ),
            Job.status.in_(ACTIVE_STATUSES),
        )
        .order_by(Job.created_at)
        .limit(20)
    ).all()
    if users:
        listed = ", ".join(f"{job_id} ({status})" for job_id, status in users)
        raise ConflictError(
            f"dataset {row.id!r} is used by jobs that have not finished: {listed}; "
            "cancel them or wait for them to finish",
            details={"jobs": [job_id for job_id, _ in users]},
        )
    row.deleted_at = utcnow()
    source, sha, key = row.source, row.sha256, row.archive_key
    session.commit()
    log.info("dataset %s deleted by %s", row.id, principal.name)
    if key is not None:
        _release_archive(session, settings, key)
    elif source == SOURCE_UPLOAD:
        _release_content(session, settings, sha)


def _release_archive(session: Session, settings: Settings, key: str) -> None:
    """Remove the object ``key`` if no visible dataset uses it any more."""
    with _store_lock(settings):
        users = session.scalar(
            select(func.count())
            .select_from(Dataset)
            .where(Dataset.archive_key == key, Dataset.deleted_at.is_(None))
        )
        session.commit()
        if not users:
            delete_object(direct_uploads.storage_of(settings), key)


def _release_content(session: Session, settings: Settings, sha: str) -> None:
    """Remove the stored copy of ``sha`` if no visible dataset uses it any more."""
    with _store_lock(settings):
        users = session.scalar(
            select(func.count())
            .select_from(Dataset)
            .where(Dataset.sha256 == sha, Dataset.source == SOURCE_UPLOAD, Dataset.deleted_at.is_(None))
        )
        session.commit()
        target = datasets_dir(settings) / sha
        if users or not target.exists():
            return
        # Rename first: the content disappears from the store at once, then is removed.
        trash = staging_dir(settings) / f"deleted-{uuid.uuid4().hex}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        os.rename(target, trash)
    shutil.rmtree(trash, ignore_errors=True)


# ---------------------------------------------------------------------------- job submission


def resolve_job_datasets(
    session: Session, principal: Principal, train_id: str, val_id: str
) -> tuple[Dataset, Dataset]:
    """Both datasets of a job, visible to the submitter and with equal label sets.

    Each may be given by id, name or unique id prefix (as the CLI accepts). Another
    user's or a deleted dataset is a 404 naming the field (admin may use any); differing
    label sets are a 422 InvalidDatasetError naming the labels missing on each side.
    """
    by_id = _share_locked_by_id(session, principal, [train_id, val_id])
    train = by_id.get(train_id) or dataset_field(session, principal, train_id, "train_dataset")
    val = by_id.get(val_id) or dataset_field(session, principal, val_id, "validation_dataset")
    train_labels, val_labels = set(train.classes), set(val.classes)
    if train_labels != val_labels:
        only_train = sorted(train_labels - val_labels)
        only_val = sorted(val_labels - train_labels)
        raise InvalidDatasetError(
            "training and validation datasets must have the same labels: "
            f"missing in validation: {only_train or 'none'}; missing in training: {only_val or 'none'}",
            details={"missing_in_validation": only_train, "missing_in_training": only_val},
        )
    return train, val


def _share_locked_by_id(session: Session, principal: Principal, ids: list[str]) -> dict[str, Dataset]:
    """The datasets among ``ids`` that are given by their whole id and visible to the
    principal, share-locked, in one query. A reference it leaves out (a name, an id prefix,
    another user's or an unknown dataset) is looked up on its own, as :func:`dataset_field`
    does, with the same answer and error."""
    wanted = sorted({ref for ref in ids if refs.comparable(ref)})
    if not wanted:
        return {}
    if principal.is_admin:
        rows = session.scalars(_BY_IDS_ANY_OWNER, {"ids": wanted})
    else:
        rows = session.scalars(_BY_IDS_OWNED, {"ids": wanted, "owners": list(principal.owners)})
    return {row.id: row for row in rows}


# What _share_locked_by_id runs on every training submission, built once (the visibility of
# refs.find_owned: not deleted, and its user's unless admin).
_BY_IDS_ANY_OWNER = (
    select(Dataset)
    .where(Dataset.id.in_(bindparam("ids", expanding=True)), Dataset.deleted_at.is_(None))
    .with_for_update(read=True)
)
_BY_IDS_OWNED = _BY_IDS_ANY_OWNER.where(Dataset.owner_id.in_(bindparam("owners", expanding=True)))


# ---------------------------------------------------------------------------- workers


def dataset_for_worker(session: Session, principal: Principal, dataset_id: str) -> Dataset:
    """The dataset a worker asks for, if a job placed on one of its nodes uses it."""
    row = session.scalars(
        select(Dataset).where(Dataset.id == dataset_id, Dataset.deleted_at.is_(None))
    ).first()
    if row is None:
        raise NotFoundError(f"dataset {dataset_id!r} not found")
    placed = session.scalars(
        select(Placement.id)
        .join(Node, Node.id == Placement.node_id)
        .join(Job, Job.id == Placement.job_id)
        .where(
            speaks_for(principal),
            Placement.status != PlacementStatus.DONE,
            or_(
                Job.train_dataset_id == row.id,
                Job.validation_dataset_id == row.id,
                Job.id.in_(select(JobInput.job_id).where(JobInput.dataset_id == row.id)),
            ),
        )
        .limit(1)
    ).first()
    if placed is None:
        raise PermissionDeniedError(
            f"dataset {dataset_id!r} is not used by any job placed on this worker's nodes"
        )
    return row


def dataset_tar(settings: Settings, row: Dataset) -> DatasetTar:
    """The deterministic tar of a dataset's files (what workers download and verify)."""
    root = data_root(settings, row)
    if not root.is_dir():
        raise NotFoundError(f"the files of dataset {row.id!r} are missing from {root}")
    link_roots = allowed_roots(settings) if row.source == SOURCE_PATH else None
    return DatasetTar(root, list_files(root, link_roots=link_roots))
