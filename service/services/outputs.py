"""Script jobs' outputs (docs/script-jobs.md): the output folder of node rank 0 (of every node with
``"outputs": "all"``), uploaded by the agents when the job ends, succeeded or failed.

Stored as ``<data dir>/outputs/<job id>.tar.gz`` (what ``GET /v1/jobs/{id}/outputs``
serves, ETag = sha256). With ``"outputs": "all"`` each node's upload is kept as
``<job id>/node-<rank>.tar.gz`` and the served archive is rebuilt from all of them, each
under ``node-<rank>/``. An upload is streamed to a temporary file, its sha256 checked
against the announced one, its members checked (regular files and folders with safe
names only) and counted: past :data:`~torchyard.contract.archive.MAX_OUTPUTS_FILES`
entries or :data:`~torchyard.contract.archive.MAX_OUTPUTS_UNCOMPRESSED_BYTES` bytes once
unpacked (all nodes' together with ``"outputs": "all"``) it is refused with 413 and
nothing is kept; then it is moved into place with one rename. Single files asked for with
``?path=`` are extracted once into ``<job id>.files/`` and served from there, each read
from the archive's index (:mod:`service.services.outputs_index`): the archive is read
whole once per API process, not once per file.
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

from service.db.models import Job
from service.db.types import utcnow
from service.services.artifacts import ModelFile
from service.services.incoming import IncomingOutputs
from service.services.job_lookup import get_job
from service.services.kinds import kind_of
from service.services.leases import lock_lease, placement_for_lease
from service.services.outputs_index import ArchiveReadError, copy_file, index_of
from service.services.tokens import Principal
from service.states import LIVE_STATUSES, JobStatus
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
    StaleLeaseError,
)
from torchyard.contract.files import locked, sha256_file

log = logging.getLogger(__name__)

# Where a job's outputs may still be uploaded from: placed, or just failed or cancelling
# (node 0 uploads what it has after another node's failure ended the job).
_UPLOAD_STATUSES = LIVE_STATUSES | {JobStatus.FAILED}


class OutputsStore:
    def __init__(self, data_dir: Path) -> None:
        self.root = Path(data_dir) / "outputs"
        self.incoming = self.root / ".incoming"

    def archive(self, job_id: str) -> Path:
        return self.root / f"{job_id}.tar.gz"

    def node_archive(self, job_id: str, node_rank: int) -> Path:
        return self.root / job_id / f"node-{node_rank}.tar.gz"

    def files_dir(self, job_id: str) -> Path:
        return self.root / f"{job_id}.files"

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


def _combine(store: OutputsStore, job_id: str, target: Path, incoming: tuple[int, Path]) -> None:
    """One archive of every node's outputs, each under ``node-<rank>/`` (sorted, fixed times):
    the stored ones, with ``incoming`` (node rank, file) in place of that node's. 413 when
    they hold more than the caps together (``target`` is then left half-written)."""
    stored = {int(p.name[5:].split(".")[0]): p for p in (store.root / job_id).glob("node-*.tar.gz")}
    stored[incoming[0]] = incoming[1]
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
    """Move a checked upload into the store and record it on the job, under the lease; commits."""
    job, placement = lock_lease(session, principal, lease_token, job_id=job_id)
    _check_uploader(job, placement.node_rank)
    target = store.archive(job_id)
    with store.lock(job_id):
        shutil.rmtree(store.files_dir(job_id), ignore_errors=True)
        if job.spec.get("outputs") == "all":
            node_file = store.node_archive(job_id, placement.node_rank)
            node_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = store.incoming / f"combined-{job_id}.tar.gz"
            try:
                _combine(store, job_id, tmp, (placement.node_rank, incoming.path))
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(incoming.path, node_file)
            os.replace(tmp, target)
            digest, size = sha256_file(target), target.stat().st_size
        else:
            os.replace(incoming.path, target)
            digest, size = sha256, incoming.size
        job.outputs_sha256 = digest
        job.outputs_size = size
        job.updated_at = utcnow()
        session.commit()
    log.info("job %s: outputs stored from node rank %d (%d bytes)", job_id, placement.node_rank, size)
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
    path = store.archive(job.id)
    if not path.is_file():
        raise NotFoundError(f"the outputs of job {job.id} are missing from the artifact store")
    return ModelFile(
        path=path,
        sha256=job.outputs_sha256,
        size=job.outputs_size or 0,
        filename=f"{job.name}-{job.id}-outputs.tar.gz",
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
            index = index_of(archive.path, archive.sha256)
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
                    copy_file(archive.path, index, rel, out)
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
