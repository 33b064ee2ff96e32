"""The model registry (docs/models.md): named, numbered versions of trained model directories.

A version points at a succeeded training job, or at a succeeded script job and the
folder of its outputs that holds a model directory (``path``, packed into the model store
as the job's model archive when first registered); the job's archive in the model store
is the version's content (its sha256 is the version's). Versions count up per owner (the
user of the token that registers, docs/teams.md) and name, and a deleted version's number is
never given again. Models are private to their owner: another user's model is a 404, as for
datasets; only the owner registers a job's model (a teammate, who may read the job, gets 403).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Job, ModelVersion
from service.db.types import utcnow
from service.schemas.models import ModelPublic, ModelVersionPublic
from service.services.artifacts import UNPACK_RATIO, ModelStore
from service.services.job_lookup import get_job
from service.services.kinds import kind_of
from service.services.model_versions import get_version as get_version  # also the routes' lookup
from service.services.outputs import OutputsStore, extract_folder, outputs_for_user
from service.services.ownership import first_team, owner_tokens
from service.services.tokens import Principal
from service.states import FINAL_STATUSES, JobStatus
from torchyard.contract.errors import (
    ConflictError,
    InvalidModelDirectoryError,
    ModelNotReadyError,
    NotFoundError,
)
from torchyard.contract.model_archive import (
    CONFIG_FILE,
    MANIFEST_FILE,
    MAX_CONFIG_BYTES,
    MAX_MEMBERS,
    check_model_config,
    pack_model_dir,
    read_manifest,
)
from torchyard.contract.onnx_graph import OnnxGraphError, check_operators
from torchyard.scoring import ONNX_FILE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelFiles:
    """Where a version's unpacked model directory is, and what identifies it."""

    key: str
    folder: Path
    sha256: str


def version_public(row: ModelVersion, top1: float | None = None) -> ModelVersionPublic:
    return ModelVersionPublic(
        top1=top1,
        name=row.name,
        version=row.version,
        job_id=row.job_id,
        path=row.path,
        architecture=row.architecture,
        classes=list(row.classes),
        image_size=row.image_size,
        sha256=row.sha256,
        onnx=row.has_onnx,
        created_at=row.created_at,
    )


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidModelDirectoryError(f"the model directory's config.json cannot be read: {exc}") from exc
    if not isinstance(config, dict) or not isinstance(config.get("classes"), list):
        raise InvalidModelDirectoryError("the model directory's config.json has no class list")
    return config


def unpacked_job_model(settings: Settings, job: Job) -> Path:
    if job.model_sha256 is None:
        raise ModelNotReadyError(f"job {job.id} has no model directory")
    store = ModelStore.of(settings)
    local = store.storage.local_path(store.key(job.id, job.model_key))
    if local is not None and not local.is_file():
        raise NotFoundError(f"the model archive of job {job.id} is missing from the artifact store")
    # Object storage: fetched once from the store to be unpacked (the API reads it to serve predictions).
    return store.unpacked(job.id, job.model_sha256, settings.model_max_bytes * UNPACK_RATIO, job.model_key)


def register_model(
    session: Session, settings: Settings, principal: Principal, name: str, job_ref: str, path: str | None
) -> ModelVersion:
    """Register the model directory of a succeeded training job, or the one a succeeded
    script job wrote to the folder ``path`` of its outputs, as the next version of ``name``."""
    job = get_job(session, principal, job_ref, write=True)
    kind_of(job).check_registration(job, path)
    if job.status != JobStatus.SUCCEEDED:
        raise ModelNotReadyError(
            f"job {job.id} is {job.status}: only a succeeded job's model can be registered"
        )
    source: str | None = None
    if path is not None:
        source = store_script_model(session, settings, principal, job, path)
    folder = unpacked_job_model(settings, job)
    config = _read_config(folder)
    onnx = config.get("onnx") or {}
    has_onnx = bool(onnx.get("file")) and (folder / ONNX_FILE).is_file()
    latest = session.scalar(
        select(func.max(ModelVersion.version)).where(
            ModelVersion.owner_id.in_(principal.owners), ModelVersion.name == name
        )
    )
    row = ModelVersion(
        owner_id=principal.id,
        team_id=first_team(principal),
        name=name,
        version=(latest or 0) + 1,
        job_id=job.id,
        path=source,
        architecture=str(config.get("architecture", job.architecture)),
        classes=[str(c) for c in config["classes"]],
        image_size=int(config.get("image_size", 0)),
        sha256=job.model_sha256 or "",
        has_onnx=has_onnx,
        created_at=utcnow(),
    )
    session.add(row)
    try:
        session.commit()
    except IntegrityError as exc:
        session.rollback()
        raise ConflictError(
            f"another version of model {name!r} was registered at the same moment; try again"
        ) from exc
    shown = f"job {job.id}" + (f" (outputs folder {source})" if source else "")
    log.info("model %s version %d registered from %s", name, row.version, shown)
    return row


def _checked_model_folder(folder: Path, names: list[str], rel: str) -> None:
    """The files copied out of the outputs are a model directory: a manifest listing
    every file, ``config.json`` as scoring and evaluation need it."""
    listed = read_manifest(folder)
    unlisted = sorted(set(names) - set(listed) - {MANIFEST_FILE})
    if unlisted:
        raise InvalidModelDirectoryError(
            f"holds files its {MANIFEST_FILE} manifest does not list: {', '.join(unlisted)}"
        )
    missing = sorted(set(listed) - set(names))
    if missing:
        raise InvalidModelDirectoryError(f"{MANIFEST_FILE} lists {', '.join(missing)}, which is missing")
    config_path = folder / CONFIG_FILE
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise InvalidModelDirectoryError(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidModelDirectoryError(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    check_model_config(config, listed)
    if ONNX_FILE in listed:
        # Scored by the API: only the operators torchvision classifiers export to.
        try:
            check_operators((folder / ONNX_FILE).read_bytes())
        except OnnxGraphError as exc:
            raise InvalidModelDirectoryError(str(exc)) from None


def store_script_model(
    session: Session, settings: Settings, principal: Principal, job: Job, path: str
) -> str:
    """Pack the model directory in the folder ``path`` of a script job's outputs into the
    model store as the job's model archive (as a training job's is); the folder's path.

    A script job holds one model directory: registering another folder whose content
    differs from the one stored is a 409.
    """
    outputs = OutputsStore.of(settings)
    archive = outputs_for_user(session, principal, outputs, job.id)
    store = ModelStore.of(settings)
    store.incoming.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="register-", dir=store.incoming))
    try:
        folder = work / "model"
        folder.mkdir()
        rel, names = extract_folder(
            outputs.local_archive(job.id, archive),
            path,
            folder,
            max_files=MAX_MEMBERS,
            max_bytes=settings.model_max_bytes,
        )
        try:
            _checked_model_folder(folder, names, rel)
            sha256, size = pack_model_dir(folder, work / "model.tar.gz")
        except InvalidModelDirectoryError as exc:
            raise InvalidModelDirectoryError(
                f"path {rel!r} is not a model directory: {exc.message}",
                details={"field": "path", "path": rel, **(exc.details or {})},
            ) from None
        with outputs.lock(job.id):
            session.refresh(job)
            if job.model_sha256 is not None and job.model_sha256 != sha256:
                earlier = session.scalar(
                    select(ModelVersion.path).where(ModelVersion.job_id == job.id).limit(1)
                )
                raise ConflictError(
                    f"job {job.id} already holds the model directory registered from {earlier!r}; "
                    f"a script job holds one model directory, and {rel!r} differs from it",
                    details={"field": "path", "registered": earlier},
                )
            if job.model_sha256 is None:
                key = store.new_key(job.id)
                store.storage.adopt_file(key, work / "model.tar.gz")
                job.model_sha256, job.model_size = sha256, size
                job.model_key = key if store.storage.direct else None
                job.updated_at = utcnow()
                session.commit()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rel


def _versions(session: Session, principal: Principal, name: str | None = None) -> list[ModelVersion]:
    stmt = select(ModelVersion).where(
        ModelVersion.owner_id.in_(principal.owners), ModelVersion.deleted_at.is_(None)
    )
    if name is not None:
        stmt = stmt.where(ModelVersion.name == name)
    return list(session.scalars(stmt.order_by(ModelVersion.name, ModelVersion.version)))


def source_top1(session: Session, rows: list[ModelVersion]) -> dict[str, float]:
    """The best validation top-1 each version's source job reported, by job id (one query)."""
    ids = {row.job_id for row in rows}
    if not ids:
        return {}
    found: dict[str, float] = {}
    for job_id, best in session.execute(select(Job.id, Job.best).where(Job.id.in_(ids))):
        value = best.get("val.top1") if isinstance(best, dict) else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            found[job_id] = float(value)
    return found


def _model_public(session: Session, name: str, rows: list[ModelVersion]) -> ModelPublic:
    top1 = source_top1(session, rows)
    return ModelPublic(
        name=name,
        latest_version=rows[-1].version,
        versions=[version_public(r, top1.get(r.job_id)) for r in rows],
    )


def list_models(session: Session, principal: Principal) -> list[ModelPublic]:
    by_name: dict[str, list[ModelVersion]] = {}
    for row in _versions(session, principal):
        by_name.setdefault(row.name, []).append(row)
    return [_model_public(session, name, rows) for name, rows in by_name.items()]


def get_model(session: Session, principal: Principal, name: str) -> ModelPublic:
    rows = _versions(session, principal, name)
    if not rows:
        raise NotFoundError(f"model {name!r} not found")
    return _model_public(session, name, rows)


def live_evaluations(session: Session, row: ModelVersion) -> list[str]:
    """Ids of the unfinished evaluation jobs that use the version."""
    # Any token of the version's user may have submitted them.
    owners = owner_tokens(session, row.owner_id)
    jobs = session.scalars(select(Job).where(Job.owner_id.in_(owners), Job.status.not_in(FINAL_STATUSES)))
    return [j.id for j in jobs if kind_of(j).uses_version(j, row.id)]


def delete_version(session: Session, principal: Principal, name: str, version: str) -> ModelVersion:
    row = get_version(session, principal, name, version)
    users = live_evaluations(session, row)
    if users:
        raise ConflictError(
            f"model {name}:{row.version} is used by the running evaluation job(s) {', '.join(users)}",
            details={"jobs": users},
        )
    row.deleted_at = utcnow()
    session.commit()
    return row


def model_files(session: Session, settings: Settings, row: ModelVersion) -> ModelFiles:
    job = session.get_one(Job, row.job_id)
    folder = unpacked_job_model(settings, job)
    return ModelFiles(key=f"{row.job_id}-{row.sha256}", folder=folder, sha256=row.sha256)
