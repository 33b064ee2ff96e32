"""Direct uploads (docs/storage.md): with object storage, a client PUTs an artifact's parts
to the store with presigned URLs, then asks the API to complete it.

The kind's route authorizes the caller first (its token, its lease), then
:func:`plan_upload` records the upload (one ``object_uploads`` row) and hands out the parts'
URLs; asking again with the same request resumes it (fresh URLs, and the parts the store
already holds). :func:`take_upload` makes the parts one object, verified by the store
(each part's sha256 is signed into its URL); the kind then publishes the key on its row
in the same transaction and the upload row goes. Nothing is visible before that: the
object's key is new for every upload, so an upload that is refused, abandoned or
completed under a stale lease replaces nothing, and its object and parts are removed
(:func:`discard`, and the upkeep's :func:`drop_abandoned`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.engine import Database
from service.db.models import ObjectUpload
from service.db.types import new_id, utcnow
from service.storage import ObjectStorage, open_storage
from service.storage.base import StorageError, UploadIncomplete, UploadTargets
from torchyard.contract.errors import (
    ConflictError,
    NotFoundError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RequestValidationError,
    ServiceUnavailableError,
)
from torchyard.contract.transfer import PartUpload, UploadPlan, UploadRequest, part_sizes

log = logging.getLogger(__name__)

Published = TypeVar("Published")


def storage_of(settings: Settings) -> ObjectStorage:
    """The artifact store the settings name (one per process)."""
    return open_storage(settings.storage_url, settings.data_dir)


def api_plan(put_url: str) -> UploadPlan:
    """The plan of file storage: PUT the body to the API's own route."""
    return UploadPlan(mode="api", put_url=put_url)


def _check_request(request: UploadRequest, limit: int, what: str) -> None:
    if request.size > limit:
        raise PayloadTooLargeError(f"{what} of {request.size} bytes exceeds the limit of {limit} bytes")
    expected = len(part_sizes(request.size, request.part_bytes))
    if len(request.part_sha256) != expected:
        raise RequestValidationError(
            f"part_sha256 must hold {expected} checksums: the file of {request.size} bytes cut every "
            f"{request.part_bytes} bytes makes {expected} parts",
            details={"parts": expected},
        )
    bad = [i for i, d in enumerate(request.part_sha256) if len(d) != 64 or d.strip("0123456789abcdef")]
    if bad:
        raise RequestValidationError(f"part_sha256[{bad[0]}] is not 64 lowercase hex digits")
    if expected == 1 and request.part_sha256[0] != request.sha256:
        raise RequestValidationError("a file of one part has that part's sha256 as its own")


def _store_call(what: str, fn: Callable[[], UploadTargets]) -> UploadTargets:
    try:
        return fn()
    except StorageError as exc:
        log.error("%s: %s", what, exc)
        raise ServiceUnavailableError(f"the object store did not answer: {exc}") from exc


def plan_upload(
    session: Session,
    storage: ObjectStorage,
    settings: Settings,
    request: UploadRequest,
    *,
    kind: str,
    owner_id: str,
    key_for: Callable[[str], str],
    complete_url: Callable[[str], str],
    limit: int,
    what: str,
    job_id: str | None = None,
    details: dict[str, Any] | None = None,
) -> UploadPlan:
    """Record a direct upload of ``request`` (or find the same one begun earlier) and hand
    out its parts' presigned URLs. ``key_for(upload id)`` names its object. Commits."""
    _check_request(request, limit, what)
    details = details or {}
    found = session.scalars(
        select(ObjectUpload).where(
            ObjectUpload.kind == kind,
            ObjectUpload.owner_id == owner_id,
            ObjectUpload.sha256 == request.sha256,
        )
    ).all()
    row = next(
        (
            r
            for r in found
            if r.size_bytes == request.size
            and r.part_bytes == request.part_bytes
            and r.part_sha256 == request.part_sha256
            and r.job_id == job_id
            and r.details == details
        ),
        None,
    )
    ttl = settings.storage_url_ttl_s
    if row is not None:
        resumed = row
        targets = _store_call(
            f"resuming upload {row.id}",
            lambda: storage.resume_upload(
                resumed.key,
                resumed.store_upload_id,
                sha256=resumed.sha256,
                size=resumed.size_bytes,
                part_bytes=resumed.part_bytes,
                part_sha256=resumed.part_sha256,
                ttl_s=ttl,
            ),
        )
    else:
        upload_id = new_id()
        key = key_for(upload_id)
        targets = _store_call(
            f"beginning an upload to {key}",
            lambda: storage.begin_upload(
                key,
                sha256=request.sha256,
                size=request.size,
                part_bytes=request.part_bytes,
                part_sha256=request.part_sha256,
                ttl_s=ttl,
            ),
        )
        row = ObjectUpload(
            id=upload_id,
            kind=kind,
            key=key,
            owner_id=owner_id,
            job_id=job_id,
            store_upload_id=targets.upload_id,
            sha256=request.sha256,
            size_bytes=request.size,
            part_bytes=request.part_bytes,
            part_sha256=request.part_sha256,
            details=details,
            created_at=utcnow(),
        )
        session.add(row)
    session.commit()
    return UploadPlan(
        mode="direct",
        upload_id=row.id,
        complete_url=complete_url(row.id),
        parts=[PartUpload(number=p.number, url=p.url, headers=p.headers, size=p.size) for p in targets.parts],
        done=targets.done,
        expires_in_s=ttl,
    )


def job_upload_url(job_id: str, artifact: str) -> Callable[[str], str]:
    """Where a worker completes a direct upload of a job's ``artifact`` (``checkpoint``,
    ``model`` or ``outputs``): the ``complete_url`` of :func:`plan_upload`."""
    return lambda upload_id: f"/v1/worker/jobs/{job_id}/{artifact}/upload/{upload_id}"


def find_upload(session: Session, upload_id: str, *, kind: str, owners: Collection[str]) -> ObjectUpload:
    """The caller's upload in progress of ``kind``, begun by one of the tokens ``owners``
    (a user's, docs/teams.md; another's, or none: 404)."""
    row = session.get(ObjectUpload, upload_id)
    if row is None or row.kind != kind or row.owner_id not in owners:
        raise NotFoundError(f"upload {upload_id!r} not found (completed, abandoned, or never begun)")
    return row


def take_upload(session: Session, storage: ObjectStorage, row: ObjectUpload) -> None:
    """Make the upload's parts one verified object at ``row.key``: 409 while parts are
    missing (the client asks for the plan again and sends them)."""
    try:
        storage.finish_upload(
            row.key,
            row.store_upload_id,
            sha256=row.sha256,
            size=row.size_bytes,
            part_bytes=row.part_bytes,
            part_sha256=row.part_sha256,
        )
    except UploadIncomplete as exc:
        raise ConflictError(f"the upload is not complete: {exc}; ask for its plan again to resume") from exc
    except StorageError as exc:
        raise ServiceUnavailableError(f"the object store did not answer: {exc}") from exc
    # A completed multipart upload is an object now: dropping it later needs no upload id.
    row.store_upload_id = None


def discard(storage: ObjectStorage, key: str, store_upload_id: str | None) -> None:
    """Remove an upload that will never be published: its parts, or its object."""
    try:
        storage.abort_upload(key, store_upload_id)
    except StorageError as exc:
        log.warning("could not remove the abandoned upload %s: %s", key, exc)


def refuse(db: Database, storage: ObjectStorage, upload_id: str) -> None:
    """Drop an upload whose publication was refused (stale lease, wrong state...): row and object."""
    with db.session() as session:
        row = session.get(ObjectUpload, upload_id)
        if row is None:
            return
        key, store_upload_id = row.key, row.store_upload_id
        session.delete(row)
        session.commit()
    discard(storage, key, store_upload_id)


def complete_upload(
    db: Database,
    storage: ObjectStorage,
    upload_id: str,
    *,
    kind: str,
    owner_id: str,
    job_id: str | None,
    authorize: Callable[[Session], None],
    publish: Callable[[Session, ObjectUpload], Published],
) -> Published:
    """Complete the caller's direct upload ``upload_id`` of ``kind`` for ``job_id`` (404 for
    another's or none) and publish it.

    ``authorize(session)`` checks the caller again (its lease...): a refusal (403, 409)
    drops the upload, row, parts and object, since it will never be published. Then the
    parts become one verified object (409 while parts are missing: the upload is kept, to
    be resumed), and ``publish(session, row)`` records it, deleting the row in its own
    transaction; a refused publication (403, 409: a lease gone stale meanwhile) drops the
    object too."""
    with db.session() as session:
        row = find_upload(session, upload_id, kind=kind, owners=(owner_id,))
        if row.job_id != job_id:
            raise NotFoundError(f"upload {upload_id!r} not found")
        try:
            authorize(session)
        except (ConflictError, PermissionDeniedError):
            session.rollback()
            refuse(db, storage, upload_id)
            raise
        take_upload(session, storage, row)
        session.commit()
        try:
            return publish(session, row)
        except (ConflictError, PermissionDeniedError):
            session.rollback()
            refuse(db, storage, upload_id)
            raise


def drop_abandoned(db: Database, settings: Settings) -> int:
    """Remove direct uploads left unfinished for ``storage_upload_expiry_s``: their rows,
    parts and objects, and multipart uploads in the store that no row knows; how many."""
    storage = storage_of(settings)
    if not storage.direct:
        return 0
    cutoff = utcnow() - timedelta(seconds=settings.storage_upload_expiry_s)
    with db.session() as session:
        rows = session.scalars(select(ObjectUpload).where(ObjectUpload.created_at < cutoff)).all()
        stale = [(r.key, r.store_upload_id) for r in rows]
        for r in rows:
            session.delete(r)
        session.commit()
        known = set(session.scalars(select(ObjectUpload.store_upload_id)).all())
    for key, store_upload_id in stale:
        discard(storage, key, store_upload_id)
    try:
        orphans = [(k, u) for k, u in storage.abandoned_uploads("", cutoff) if u not in known]
    except StorageError as exc:
        log.warning("could not list the object store's unfinished uploads: %s", exc)
        orphans = []
    for key, store_upload_id in orphans:
        discard(storage, key, store_upload_id)
    if stale or orphans:
        log.info("dropped %d abandoned direct uploads", len(stale) + len(orphans))
    return len(stale) + len(orphans)
