"""The weights store: state dicts that ``pretrained: true`` training jobs start from (no HTTP).

Any user uploads weights for a torchvision architecture; every user's jobs may use them;
only an admin deletes them. A file is kept once per content under
``<data dir>/weights/<sha256>.pth``. What the service checks without torch: the
architecture is one the trainer builds, the file is a torch archive (``torch.save``'s zip
format), and a file named like torchvision's own (``resnet50-0676ba61.pth``: the first hex
digits of its sha256 after the last ``-``) hashes to that prefix. The node checks that the
state dict fits the architecture when it loads it (docs/fine-tuning.md).

A training job with ``pretrained: true`` is accepted when weights for its architecture
are stored, or when a ready node said at registration that it downloads the default
weights from the model hub (``TORCHYARD_WORKER_PRETRAINED_FROM_HUB=1``); its claim carries
the newest stored weights of the architecture.
"""

from __future__ import annotations

import hashlib
import os
import re
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from service.config import Settings
from service.datasets import staging
from service.db.models import Node, ObjectUpload, PretrainedWeights
from service.db.types import new_id, utcnow
from service.schemas.weights import WeightsUploadRequest
from service.services import direct_uploads
from service.services.architectures import check_architecture
from service.services.stored_archives import StoredFile, delete_object, stored_file
from service.services.tokens import Principal
from service.states import NodeStatus
from service.storage import ObjectStorage
from service.storage.base import StorageError
from torchyard.contract.errors import (
    ConflictError,
    InvalidModelDirectoryError,
    NotFoundError,
    PermissionDeniedError,
    ServiceUnavailableError,
)
from torchyard.contract.protocol import ClaimedWeights
from torchyard.contract.responses import WeightsPublic
from torchyard.contract.transfer import UploadPlan

# torch.save writes a zip archive (torch >= 1.6); the legacy pickle format is not accepted.
ZIP_MAGIC = b"PK\x03\x04"
# torchvision's (and torch hub's) file names: "<name>-<first hex digits of the sha256>.<ext>".
_HASH_IN_NAME = re.compile(r"-([0-9a-f]{8,64})\.[A-Za-z0-9]+$")
FILENAME_MAX = 255
# The key a node's registration info carries when it downloads the default weights itself.
HUB_INFO_KEY = "pretrained_from_hub"
HUB_SETTING = "TORCHYARD_WORKER_PRETRAINED_FROM_HUB=1"


def store_dir(settings: Settings) -> Path:
    return settings.data_dir / "weights"


def weights_file(settings: Settings, row: PretrainedWeights) -> Path:
    return store_dir(settings) / f"{row.sha256}.pth"


def weights_key(sha: str) -> str:
    """The object of the file of content ``sha`` (the file layout's path, in any store)."""
    return f"weights/{sha}.pth"


_DIRECT_KIND = "weights"


def plan_direct_upload(
    session: Session,
    settings: Settings,
    storage: ObjectStorage,
    principal: Principal,
    body: WeightsUploadRequest,
) -> UploadPlan:
    """Object storage: the checks that need no byte of the file (the architecture, a sha256
    prefix in the file's name against the announced sha256, which the store verifies), then
    the direct upload's plan (docs/storage.md). That the file is a torch archive is the
    client's to check before it uploads, and the node's when it loads it."""
    check_architecture(body.architecture, field="architecture")
    filename = Path(body.filename or "weights.pth").name
    check_name(filename, body.sha256)
    details: dict[str, Any] = {"architecture": body.architecture, "filename": filename}
    if _already_stored(session, storage, body.sha256):
        return _plan_stored(session, settings, principal, body, details)
    return direct_uploads.plan_upload(
        session,
        storage,
        settings,
        body,
        kind=_DIRECT_KIND,
        owner_id=principal.id,
        key_for=lambda _upload_id: weights_key(body.sha256),
        complete_url=lambda upload_id: f"/v1/weights/uploads/{upload_id}",
        limit=settings.max_weights_upload_bytes,
        what="the weights file",
        details=details,
    )


def _already_stored(session: Session, storage: ObjectStorage, sha: str) -> bool:
    """Whether the file of content ``sha`` is stored for a row already (its object verified)."""
    if session.scalars(select(PretrainedWeights.id).where(PretrainedWeights.sha256 == sha)).first() is None:
        return False
    try:
        return storage.head(weights_key(sha)) is not None
    except StorageError as exc:
        raise ServiceUnavailableError(f"the object store did not answer: {exc}") from exc


def _plan_stored(
    session: Session,
    settings: Settings,
    principal: Principal,
    body: WeightsUploadRequest,
    details: dict[str, Any],
) -> UploadPlan:
    """The plan of a file stored already: no part to send, only the completion. Its upload
    row names no object of its own (the key is the file's, shared by content: an upload of it
    that is abandoned, or refused, must not remove it)."""
    upload_id = new_id()
    session.add(
        ObjectUpload(
            id=upload_id,
            kind=_DIRECT_KIND,
            key=f"weights/{body.sha256}/{upload_id}.stored",
            owner_id=principal.id,
            job_id=None,
            store_upload_id=None,
            sha256=body.sha256,
            size_bytes=body.size,
            part_bytes=body.part_bytes,
            part_sha256=body.part_sha256,
            details={**details, "stored": True},
            created_at=utcnow(),
        )
    )
    session.commit()
    return UploadPlan(
        mode="direct",
        upload_id=upload_id,
        complete_url=f"/v1/weights/uploads/{upload_id}",
        expires_in_s=settings.storage_url_ttl_s,
    )


def complete_direct_upload(
    session: Session, storage: ObjectStorage, principal: Principal, upload_id: str
) -> PretrainedWeights:
    """Record the weights of a completed direct upload (409 while parts are missing); the
    same file for the same architecture answers its row again."""
    upload = direct_uploads.find_upload(session, upload_id, kind=_DIRECT_KIND, owners=principal.owners)
    if not upload.details.get("stored"):
        direct_uploads.take_upload(session, storage, upload)
    elif not _already_stored(session, storage, upload.sha256):
        session.delete(upload)
        session.commit()
        raise ConflictError("the stored file this upload reused was deleted meanwhile; upload it again")
    architecture = str(upload.details["architecture"])
    row = session.scalars(
        select(PretrainedWeights).where(
            PretrainedWeights.architecture == architecture, PretrainedWeights.sha256 == upload.sha256
        )
    ).first()
    if row is None:
        row = PretrainedWeights(
            architecture=architecture,
            filename=str(upload.details["filename"])[:FILENAME_MAX],
            sha256=upload.sha256,
            size_bytes=upload.size_bytes,
            uploaded_by=principal.id,
        )
        session.add(row)
    session.delete(upload)
    session.commit()
    return row


def stored(settings: Settings, row: PretrainedWeights) -> StoredFile:
    """The weights' file as served to a node (object storage: 404 when the store lost it)."""
    storage = direct_uploads.storage_of(settings)
    return stored_file(
        storage, weights_key(row.sha256), sha256=row.sha256, filename=row.filename, what=f"weights {row.id!r}"
    )


def upload_workspace(settings: Settings, principal: Principal) -> AbstractContextManager[Path]:
    """A private folder for one upload (see :func:`service.datasets.staging.workspace`)."""
    return staging.workspace(
        store_dir(settings) / ".staging",
        owner=principal.id,
        max_per_owner=settings.max_concurrent_uploads_per_user,
        what="weights",
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_file(path: Path, filename: str) -> str:
    """The file's sha256, after the checks the service can make without torch (422 otherwise)."""
    with open(path, "rb") as fh:
        magic = fh.read(len(ZIP_MAGIC))
    if magic != ZIP_MAGIC:
        raise InvalidModelDirectoryError(
            f"{filename} is not a torch state dict archive (torch.save(model.state_dict(), path) "
            "writes one); the file does not start as a zip archive does",
            details={"field": "file"},
        )
    sha = _sha256(path)
    check_name(filename, sha)
    return sha


def check_name(filename: str, sha: str) -> None:
    """422 when ``filename`` names a sha256 prefix (torchvision's ``resnet50-0676ba61.pth``)
    that ``sha`` does not start with."""
    named = _HASH_IN_NAME.search(filename)
    if named is not None and not sha.startswith(named.group(1)):
        raise InvalidModelDirectoryError(
            f"{filename} names the sha256 prefix {named.group(1)}, but the file's sha256 is {sha}: "
            "it is damaged or not the published file",
            details={"field": "file", "expected_prefix": named.group(1), "sha256": sha},
        )


def create(
    session: Session,
    settings: Settings,
    principal: Principal,
    architecture: str,
    filename: str,
    upload: Path,
) -> PretrainedWeights:
    """Check an uploaded file, keep it in the store and record it (the same file for the same
    architecture is recorded once: its row is returned again)."""
    check_architecture(architecture, field="architecture")
    sha = check_file(upload, filename)
    existing = session.scalars(
        select(PretrainedWeights).where(
            PretrainedWeights.architecture == architecture, PretrainedWeights.sha256 == sha
        )
    ).first()
    if existing is not None:
        return existing
    size = upload.stat().st_size
    storage = direct_uploads.storage_of(settings)
    if storage.direct:
        storage.adopt_file(weights_key(sha), upload)
    else:
        store = store_dir(settings)
        store.mkdir(parents=True, exist_ok=True)
        os.replace(upload, store / f"{sha}.pth")
    row = PretrainedWeights(
        architecture=architecture,
        filename=filename[:FILENAME_MAX],
        sha256=sha,
        size_bytes=size,
        uploaded_by=principal.id,
    )
    session.add(row)
    session.commit()
    return row


def list_weights(session: Session, architecture: str | None = None) -> list[PretrainedWeights]:
    """Newest first; only ``architecture``'s when given."""
    query = select(PretrainedWeights).order_by(
        PretrainedWeights.created_at.desc(), PretrainedWeights.id.desc()
    )
    if architecture is not None:
        query = query.where(PretrainedWeights.architecture == architecture)
    return list(session.scalars(query))


def get_weights(session: Session, weights_id: str) -> PretrainedWeights:
    row = session.get(PretrainedWeights, weights_id)
    if row is None:
        raise NotFoundError(f"no weights {weights_id!r}")
    return row


def delete_weights(session: Session, settings: Settings, principal: Principal, weights_id: str) -> None:
    """Delete stored weights (admin only); the file goes when no other row holds it. Queued
    jobs of the architecture then start from other stored weights, the hub, or fail."""
    if not principal.is_admin:
        raise PermissionDeniedError("only an admin deletes stored weights")
    row = get_weights(session, weights_id)
    sha = row.sha256
    session.execute(delete(PretrainedWeights).where(PretrainedWeights.id == row.id))
    session.commit()
    if session.scalars(select(PretrainedWeights.id).where(PretrainedWeights.sha256 == sha)).first() is None:
        storage = direct_uploads.storage_of(settings)
        if storage.direct:
            delete_object(storage, weights_key(sha))
        else:
            (store_dir(settings) / f"{sha}.pth").unlink(missing_ok=True)


def newest_for(session: Session, architecture: str) -> PretrainedWeights | None:
    weights = list_weights(session, architecture)
    return weights[0] if weights else None


def hub_node_ready(session: Session) -> bool:
    """Whether a ready node downloads the default weights from the model hub."""
    infos = session.scalars(select(Node.info).where(Node.status == NodeStatus.READY))
    return any(isinstance(info, dict) and info.get(HUB_INFO_KEY) is True for info in infos)


def check_available(session: Session, architecture: str) -> None:
    """422 unless a ``pretrained`` job of ``architecture`` can find its weights somewhere."""
    if newest_for(session, architecture) is not None or hub_node_ready(session):
        return
    raise InvalidModelDirectoryError(
        f"no pretrained weights for {architecture}: upload a state dict with "
        f"'torchyard weights upload {architecture} FILE' (POST /v1/weights), or run nodes that "
        f"download them from the model hub ({HUB_SETTING}); or train with pretrained=false",
        details={"field": "model.pretrained", "value": True, "architecture": architecture},
    )


def claimed(session: Session, model: dict[str, Any]) -> ClaimedWeights | None:
    """The stored weights a claim of a ``pretrained`` job carries (the newest of its architecture)."""
    if not model.get("pretrained"):
        return None
    row = newest_for(session, str(model["architecture"]))
    if row is None:
        return None
    return ClaimedWeights(
        id=row.id,
        architecture=row.architecture,
        filename=row.filename,
        sha256=row.sha256,
        size_bytes=row.size_bytes,
    )


def public(row: PretrainedWeights) -> WeightsPublic:
    return WeightsPublic(
        id=row.id,
        architecture=row.architecture,
        filename=row.filename,
        sha256=row.sha256,
        size_bytes=row.size_bytes,
        uploaded_by=row.uploaded_by,
        created_at=row.created_at,
    )
