"""Script jobs' outputs (docs/script-jobs.md): the output folder of node rank 0 (of every node with
``"outputs": "all"``), uploaded by the agents when the job ends, succeeded or failed.

Stored as the object ``outputs/<job id>.tar.gz`` of the artifact store (docs/storage.md;
with file storage ``<data dir>/outputs/<job id>.tar.gz``), what ``GET /v1/jobs/{id}/outputs``
serves, ETag = sha256. With object storage each upload is an object of its own,
``outputs/<job id>/<upload id>.tar.gz``, recorded in ``jobs.outputs_key`` under the lease
(the previous one removed after). With ``"outputs": "all"`` each node's upload is kept as
``outputs/<job id>/node-<rank>.tar.gz`` and the served archive is rebuilt by the API from
all of them, each under ``node-<rank>/``: such jobs upload through the API in either
storage (the plan says ``mode "api"``), and with object storage the API fetches the other
nodes' archives from the store to rebuild it and stores the result (every node's bytes
pass through the API once per node's upload). Node rank 0's outputs of other jobs go
straight to the store (a direct upload the API never reads: the agent packed only
regular files within the caps, and readers take members through
:func:`~torchyard.contract.archive.safe_member_parts`). Through the API, an upload is
streamed to a temporary file, its sha256 checked
against the announced one, its members checked (regular files and folders with safe
names only) and counted: past :data:`~torchyard.contract.archive.MAX_OUTPUTS_FILES`
entries or :data:`~torchyard.contract.archive.MAX_OUTPUTS_UNCOMPRESSED_BYTES` bytes once
unpacked (all nodes' together with ``"outputs": "all"``) it is refused with 413 and
nothing is kept; then it is moved into place with one rename. Single files asked for with
``?path=`` are extracted once into ``<job id>.files/`` and served from there, each read
from the archive's index (:mod:`service.services.outputs_index`): the archive is read
whole once per API process, not once per file. With object storage the archive is
fetched once into ``<job id>.files/`` for that (the whole archive itself is a redirect).
"""

from __future__ import annotations

import gzip
import io
import logging
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Job, ObjectUpload
from service.db.types import new_id, utcnow
from service.services.artifacts import ModelFile, object_present
from service.services.direct_uploads import storage_of
from service.services.incoming import IncomingOutputs
from service.services.job_lookup import get_job
from service.services.kinds import kind_of
from service.services.leases import lock_lease, placement_for_lease
from service.services.outputs_index import ArchiveReadError, copy_file, index_of
from service.services.tokens import Principal
from service.states import LIVE_STATUSES, JobStatus
from service.storage import FileStorage, ObjectStorage
from service.storage.base import StorageError
from torchyard.contract.archive import MAX_OUTPUTS_FILES, MAX_OUTPUTS_UNCOMPRESSED_BYTES, safe_member_parts
from torchyard.contract.deflate import SAMPLE_BYTES, GzipWriter, LevelChooser
from torchyard.contract.errors import (
    ConflictError,
    InvalidDatasetError,
    NotFoundError,
    OutputsNotReadyError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RequestValidationError,
    ServiceUnavailableError,
    StaleLeaseError,
)
from torchyard.contract.files import locked, sha256_file

log = logging.getLogger(__name__)

# Where a job's outputs may still be uploaded from: placed, or just failed or cancelling
# (node 0 uploads what it has after another node's failure ended the job).
_UPLOAD_STATUSES = LIVE_STATUSES | {JobStatus.FAILED}


class OutputsStore:
    """Outputs archives in the artifact store (objects ``outputs/...``); uploads through the
    API in progress in ``<data dir>/outputs/.incoming``, single files in ``<job id>.files``."""

    def __init__(self, data_dir: Path, storage: ObjectStorage | None = None) -> None:
        self.root = Path(data_dir) / "outputs"
        self.incoming = self.root / ".incoming"
        self.storage: ObjectStorage = storage if storage is not None else FileStorage(Path(data_dir))

    @classmethod
    def of(cls, settings: Settings) -> OutputsStore:
        return cls(settings.data_dir, storage_of(settings))

    def archive(self, job_id: str) -> Path:
        return self.root / f"{job_id}.tar.gz"

    def node_archive(self, job_id: str, node_rank: int) -> Path:
        return self.root / job_id / f"node-{node_rank}.tar.gz"

    def files_dir(self, job_id: str) -> Path:
        return self.root / f"{job_id}.files"

    def key(self, job_id: str, outputs_key: str | None = None) -> str:
        """The object of the job's served archive: ``outputs_key``, else ``outputs/<job id>.tar.gz``."""
        return outputs_key or f"outputs/{job_id}.tar.gz"

    def upload_key(self, job_id: str, upload_id: str) -> str:
        """The object of one upload of the job's archive (object storage)."""
        return f"outputs/{job_id}/{upload_id}.tar.gz"

    def node_key(self, job_id: str, node_rank: int) -> str:
        return f"outputs/{job_id}/node-{node_rank}.tar.gz"

    def new_key(self, job_id: str) -> str:
        """Where the job's next archive goes: the legacy file with file storage, a key of its
        own with object storage."""
        return self.upload_key(job_id, new_id()) if self.storage.direct else self.key(job_id)

    def drop_replaced(self, job_id: str, previous: str | None, current: str) -> None:
        if previous is None or previous == current:
            return
        try:
            self.storage.delete(previous)
        except StorageError as exc:
            log.warning("job %s: could not remove the replaced outputs archive %s: %s", job_id, previous, exc)

    def local_archive(self, job_id: str, archive: ModelFile) -> Path:
        """The served archive as a file of this machine: itself with file storage; with object
        storage a copy fetched once into ``<job id>.files/`` (removed with the next upload)."""
        if archive.path is not None:
            return archive.path
        cached = self.files_dir(job_id) / f"{archive.sha256}.tar.gz"
        if not cached.is_file():
            try:
                self.storage.get_file(archive.key, cached)
            except StorageError as exc:
                raise ServiceUnavailableError(f"the object store did not answer: {exc}") from exc
        return cached

    def start_upload(self, max_bytes: int) -> IncomingOutputs:
        self.incoming.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="upload-", suffix=".tar.gz", dir=self.incoming)
        return IncomingOutputs(Path(name), os.fdopen(fd, "wb"), max_bytes)

    @contextmanager
    def lock(self, job_id: str) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with locked(self.root / f".{job_id}.lock"):
            yield


def _check_uploader(job: Job, node_rank: int) -> None:
    if not kind_of(job).keeps_outputs:
        raise ConflictError(f"job {job.id} is a {job.type} job: it has no outputs folder")
    if node_rank != 0 and job.spec.get("outputs") != "all":
        raise PermissionDeniedError("only node rank 0 uploads the outputs (the job keeps node 0's)")
    if job.status not in _UPLOAD_STATUSES:
        raise ConflictError(f"job {job.id} is {job.status}: its outputs can no longer be uploaded")


def authorize_upload(session: Session, principal: Principal, job_id: str, lease_token: str | None) -> None:
    """Refuse an upload before its body is read (stale lease, wrong node, wrong job)."""
    placement = placement_for_lease(session, principal, lease_token)
    if placement.job_id != job_id:
        raise StaleLeaseError("the lease belongs to another job")
    _check_uploader(session.get_one(Job, job_id), placement.node_rank)


def takes_direct_upload(session: Session, store: OutputsStore, job_id: str) -> bool:
    """Whether the job's outputs may go straight to the object store: object storage, and not
    ``"outputs": "all"`` (whose served archive the API rebuilds from every node's)."""
    return store.storage.direct and session.get_one(Job, job_id).spec.get("outputs") != "all"


class _Totals:
    """What an outputs archive holds once unpacked, refused (413) past the contract's caps."""

    def __init__(self) -> None:
        self.entries = self.files = self.bytes = 0

    def add(self, member: tarfile.TarInfo) -> None:
        self.entries += 1
        if member.isreg():
            self.files += 1
            self.bytes += member.size
        if self.entries > MAX_OUTPUTS_FILES:
            raise PayloadTooLargeError(
                f"the outputs archive holds more than {MAX_OUTPUTS_FILES} entries (files and folders; "
                "MAX_OUTPUTS_FILES)",
                details={"max_files": MAX_OUTPUTS_FILES},
            )
        if self.bytes > MAX_OUTPUTS_UNCOMPRESSED_BYTES:
            raise PayloadTooLargeError(
                f"the outputs archive expands to more than {MAX_OUTPUTS_UNCOMPRESSED_BYTES} bytes "
                f"(at member {member.name!r}; MAX_OUTPUTS_UNCOMPRESSED_BYTES)",
                details={"max_uncompressed_bytes": MAX_OUTPUTS_UNCOMPRESSED_BYTES},
            )


def _check_member(member: tarfile.TarInfo) -> tuple[str, ...]:
    parts = safe_member_parts(member.name)
    if not (member.isreg() or member.isdir()) or member.issparse():
        raise RequestValidationError(f"outputs archive member {member.name!r} is not a file or folder")
    return parts


def check_archive(path: Path) -> int:
    """The upload (its checksum already checked) is a plain .tar.gz of files and folders,
    within the caps once unpacked (413 past them, from the sizes its headers declare before
    their data is read); its file count."""
    totals = _Totals()
    try:
        with tarfile.open(path, "r:gz") as tf:
            while (member := tf.next()) is not None:
                tf.members = []  # type: ignore[attr-defined]  # a walk keeps no member it has seen
                _check_member(member)
                totals.add(member)
    except InvalidDatasetError as exc:
        raise RequestValidationError(f"outputs archive: {exc.message}") from None
    except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile) as exc:
        raise RequestValidationError(f"the outputs archive cannot be read: {exc}") from None
    return totals.files


class _Prefixed:
    """``head`` (already read from ``rest``), then the rest of ``rest``: a member's data
    examined for its deflate level without seeking back in the gzip stream."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        self._head = memoryview(head)
        self._rest = rest

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (all when negative), short only at the end (tarfile's copy
        takes a short read for a truncated member)."""
        n = self._head.nbytes if size < 0 else min(size, self._head.nbytes)
        out = bytes(self._head[:n])
        self._head = self._head[n:]
        if size < 0:
            return out + self._rest.read()
        if n < size:
            out += self._rest.read(size - n)
        return out


def _stored_nodes(store: OutputsStore, job_id: str, work: Path) -> dict[int, Path]:
    """Every node's stored archive by rank, as files (object storage: fetched into ``work``)."""
    found: dict[int, Path] = {}
    try:
        for info in store.storage.list_objects(f"outputs/{job_id}/node-"):
            name = info.key.rpartition("/")[2]
            rank_text = name[5:].split(".")[0]
            if not (name.endswith(".tar.gz") and rank_text.isdecimal()):
                continue
            local = store.storage.local_path(info.key)
            if local is None:
                local = work / name
                store.storage.get_file(info.key, local)
            found[int(rank_text)] = local
    except StorageError as exc:
        raise ServiceUnavailableError(f"the object store did not answer: {exc}") from exc
    return found


def _combine(store: OutputsStore, job_id: str, target: Path, incoming: tuple[int, Path]) -> None:
    """One archive of every node's outputs, each under ``node-<rank>/`` (sorted, fixed times):
    the stored ones, with ``incoming`` (node rank, file) in place of that node's. 413 when
    they hold more than the caps together (``target`` is then left half-written)."""
    work = Path(tempfile.mkdtemp(prefix="combine-", dir=target.parent))
    try:
        stored = _stored_nodes(store, job_id, work)
        stored[incoming[0]] = incoming[1]
        _write_combined(stored, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _write_combined(stored: dict[int, Path], target: Path) -> None:
    levels = LevelChooser()  # weights and images stored, text deflated
    totals = _Totals()
    with (
        open(target, "wb") as raw,
        GzipWriter(raw) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as out,  # type: ignore[call-overload]
    ):
        for rank in sorted(stored):
            prefix = f"node-{rank}"
            folder = tarfile.TarInfo(prefix)
            folder.type, folder.mode = tarfile.DIRTYPE, 0o755
            totals.add(folder)
            out.addfile(folder)
            with tarfile.open(stored[rank], "r:gz") as tf:
                for member in tf:
                    inner = "/".join(safe_member_parts(member.name))
                    if not inner:
                        continue
                    totals.add(member)
                    member.name = f"{prefix}/{inner}"
                    data = tf.extractfile(member) if member.isreg() else None
                    if data is None:
                        out.addfile(member)
                        continue
                    head = data.read(SAMPLE_BYTES)
                    gz.set_level(levels.for_head(inner, head, member.size))
                    out.addfile(member, _Prefixed(head, data))


def publish(
    session: Session,
    principal: Principal,
    store: OutputsStore,
    job_id: str,
    lease_token: str | None,
    incoming: IncomingOutputs,
    sha256: str,
) -> Job:
    """Store a checked upload and record it on the job, under the lease; commits."""
    job, placement = lock_lease(session, principal, lease_token, job_id=job_id)
    _check_uploader(job, placement.node_rank)
    previous = store.key(job_id, job.outputs_key) if job.outputs_sha256 is not None else None
    key = store.new_key(job_id)
    with store.lock(job_id):
        shutil.rmtree(store.files_dir(job_id), ignore_errors=True)
        if job.spec.get("outputs") == "all":
            tmp = store.incoming / f"combined-{job_id}.tar.gz"
            try:
                _combine(store, job_id, tmp, (placement.node_rank, incoming.path))
                digest, size = sha256_file(tmp), tmp.stat().st_size
                store.storage.adopt_file(store.node_key(job_id, placement.node_rank), incoming.path)
                store.storage.adopt_file(key, tmp)
            finally:
                tmp.unlink(missing_ok=True)
        else:
            store.storage.adopt_file(key, incoming.path)
            digest, size = sha256, incoming.size
        job.outputs_sha256 = digest
        job.outputs_size = size
        job.outputs_key = key if store.storage.direct else None
        job.updated_at = utcnow()
        session.commit()
    store.drop_replaced(job_id, previous, key)
    log.info("job %s: outputs stored from node rank %d (%d bytes)", job_id, placement.node_rank, size)
    return job


def publish_direct(
    session: Session,
    principal: Principal,
    store: OutputsStore,
    job_id: str,
    lease_token: str | None,
    upload: ObjectUpload,
) -> Job:
    """Record outputs a node PUT to the object store (a completed direct upload, verified by
    the store) as the job's, under the lease, in the transaction that drops the upload's
    row; the previous object is removed after. Commits."""
    job, placement = lock_lease(session, principal, lease_token, job_id=job_id)
    _check_uploader(job, placement.node_rank)
    if job.spec.get("outputs") == "all":
        raise ConflictError(f"job {job_id} keeps every node's outputs: they are uploaded through the API")
    previous = store.key(job_id, job.outputs_key) if job.outputs_sha256 is not None else None
    with store.lock(job_id):
        shutil.rmtree(store.files_dir(job_id), ignore_errors=True)
        job.outputs_sha256 = upload.sha256
        job.outputs_size = upload.size_bytes
        job.outputs_key = upload.key
        job.updated_at = utcnow()
        session.delete(upload)
        session.commit()
    store.drop_replaced(job_id, previous, job.outputs_key)
    log.info("job %s: outputs stored by direct upload (%d bytes)", job_id, job.outputs_size)
    return job


def outputs_for_user(session: Session, principal: Principal, store: OutputsStore, job_id: str) -> ModelFile:
    """The outputs archive of the principal's script job; 409 until one was uploaded."""
    job = get_job(session, principal, job_id)
    if not kind_of(job).keeps_outputs:
        raise NotFoundError(f"job {job.id} is a {job.type} job: it has no outputs (see its model)")
    if job.outputs_sha256 is None:
        raise OutputsNotReadyError(
            f"job {job.id} is {job.status}: its outputs are uploaded when it ends (succeeded or failed)"
        )
    key = store.key(job.id, job.outputs_key)
    if not object_present(store.storage, key):
        raise NotFoundError(f"the outputs of job {job.id} are missing from the artifact store")
    return ModelFile(
        path=store.storage.local_path(key),
        sha256=job.outputs_sha256,
        size=job.outputs_size or 0,
        filename=f"{job.name}-{job.id}-outputs.tar.gz",
        key=key,
    )


def output_file(store: OutputsStore, archive: ModelFile, job_id: str, wanted: str) -> ModelFile:
    """One file of the outputs archive (``wanted`` relative to its root), extracted once,
    from the archive's index (the archive is not read whole again for each file)."""
    try:
        parts = safe_member_parts(wanted)
    except InvalidDatasetError:
        raise RequestValidationError(f"path {wanted!r} is not a relative path inside the outputs") from None
    rel = "/".join(parts)
    if not rel:
        raise RequestValidationError("path is empty")
    folder = store.files_dir(job_id) / archive.sha256
    dest = folder.joinpath(*parts)
    with store.lock(job_id):
        if not dest.is_file():
            local = store.local_archive(job_id, archive)
            index = index_of(local, archive.sha256)
            if index.problem is not None:
                raise PayloadTooLargeError(index.problem, details={"path": rel})
            if rel not in index.files:
                raise NotFoundError(
                    f"the outputs of job {job_id} hold no file {rel!r}", details={"path": rel}
                )
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.part")
            try:
                with open(tmp, "wb") as out:
                    copy_file(local, index, rel, out)
            except ArchiveReadError as exc:
                tmp.unlink(missing_ok=True)
                raise RequestValidationError(str(exc)) from None
            os.replace(tmp, dest)
    return ModelFile(path=dest, sha256=sha256_file(dest), size=dest.stat().st_size, filename=parts[-1])


def _folder_parts(wanted: str) -> tuple[str, ...]:
    try:
        parts = safe_member_parts(wanted)
    except InvalidDatasetError:
        raise RequestValidationError(
            f"path {wanted!r} is not a relative path inside the outputs", details={"field": "path"}
        ) from None
    if not parts:
        raise RequestValidationError(
            "path is empty: name the folder of the outputs that holds the model directory",
            details={"field": "path"},
        )
    return parts


def _copy_out(tf: tarfile.TarFile, member: tarfile.TarInfo, dest: Path) -> bool:
    """Write a member's bytes to ``dest`` (which must not exist); False if it does."""
    try:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as out:
        shutil.copyfileobj(tf.extractfile(member) or io.BytesIO(), out)
    return True


def _member_problem(member: tarfile.TarInfo, below: tuple[str, ...]) -> str | None:
    """Why a member inside the model folder is refused (None: a file directly in it)."""
    if not (member.isreg() or member.isdir()):
        return f"{'/'.join(below)} is not a regular file (links are refused)"
    if len(below) > 1 or member.isdir():
        return f"holds the folder {below[0]!r}; a model directory holds files only"
    return None


def extract_folder(
    archive: Path, wanted: str, dest: Path, *, max_files: int, max_bytes: int
) -> tuple[str, list[str]]:
    """Copy the regular files directly inside the folder ``wanted`` of an outputs archive
    into the (empty, existing) folder ``dest``; ``(the folder's normalized path, the file names)``.

    ``wanted`` must be a relative path inside the outputs: ``..``, absolute paths and
    odd names are a 422 naming ``path``; a folder the archive does not hold is a 404, a
    file where a folder is expected a 422. Anything below it but regular files (links,
    devices, sub-folders with content) is refused, and so are more than ``max_files``
    files or ``max_bytes`` bytes.
    """
    parts = _folder_parts(wanted)
    rel = "/".join(parts)

    def refuse(message: str) -> RequestValidationError:
        return RequestValidationError(f"path {rel!r}: {message}", details={"field": "path", "path": rel})

    found_folder = False
    names: list[str] = []
    total = 0
    with tarfile.open(archive, "r|gz") as tf:
        for member in tf:
            inner = safe_member_parts(member.name)
            if inner[: len(parts)] != parts:
                continue
            below = inner[len(parts) :]
            if not below and not member.isdir():
                raise refuse("is a file; name the folder that holds the model directory")
            found_folder = True
            if not below:
                continue
            problem = _member_problem(member, below)
            if problem:
                raise refuse(problem)
            names.append(below[0])
            total += member.size
            if len(names) > max_files or total > max_bytes:
                raise refuse(f"holds more than {max_files} files or {max_bytes} bytes")
            if not _copy_out(tf, member, dest / below[0]):
                raise refuse(f"holds {below[0]!r} twice")
    if not found_folder:
        raise NotFoundError(f"the outputs hold no folder {rel!r}", details={"field": "path", "path": rel})
    return rel, sorted(names)
