"""Objects as files under the data directory: the embedded default (``TORCHYARD_STORAGE_URL``
unset). A key is a relative path, so the layout is the one the service always had; the API
process moves every byte (its upload and download routes), and direct uploads do not exist."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

from service.storage.base import ObjectInfo, StorageError, UploadTargets


def check_key(key: str) -> PurePosixPath:
    """A key as a safe relative path: no empty, ``.`` or ``..`` parts, no leading slash."""
    path = PurePosixPath(key)
    if not key or path.is_absolute() or any(part in ("", ".", "..") for part in key.split("/")):
        raise StorageError(f"invalid object key {key!r}")
    return path


class FileStorage:
    direct = False

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.description = f"files under {self.root}"

    def local_path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put_file(self, key: str, source: Path) -> None:
        target = self.local_path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as out, open(source, "rb") as src:
                shutil.copyfileobj(src, out, 1 << 20)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def adopt_file(self, key: str, source: Path) -> None:
        target = self.local_path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, target)
        fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def get_file(self, key: str, dest: Path) -> None:
        source = self.local_path(key)
        if not source.is_file():
            raise StorageError(f"no object {key!r}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
        try:
            with os.fdopen(fd, "wb") as out, open(source, "rb") as src:
                shutil.copyfileobj(src, out, 1 << 20)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def head(self, key: str) -> ObjectInfo | None:
        try:
            stat = self.local_path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return ObjectInfo(key, stat.st_size, datetime.fromtimestamp(stat.st_mtime, UTC))

    def delete(self, key: str) -> None:
        self.local_path(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> int:
        found = list(self.list_objects(prefix))
        for info in found:
            self.delete(info.key)
        return len(found)

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        head, _, _ = prefix.rpartition("/")
        base = self.local_path(head) if head else self.root
        if not base.is_dir():
            return
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                path = Path(dirpath) / name
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    stat = path.stat()
                    yield ObjectInfo(key, stat.st_size, datetime.fromtimestamp(stat.st_mtime, UTC))

    def _no_direct(self) -> StorageError:
        return StorageError("file storage has no presigned URLs: the API moves the bytes")

    def download_url(self, key: str, *, filename: str, content_type: str, ttl_s: int) -> str:
        raise self._no_direct()

    def begin_upload(
        self, key: str, *, sha256: str, size: int, part_bytes: int, part_sha256: list[str], ttl_s: int
    ) -> UploadTargets:
        raise self._no_direct()

    def resume_upload(
        self,
        key: str,
        upload_id: str | None,
        *,
        sha256: str,
        size: int,
        part_bytes: int,
        part_sha256: list[str],
        ttl_s: int,
    ) -> UploadTargets:
        raise self._no_direct()

    def finish_upload(
        self,
        key: str,
        upload_id: str | None,
        *,
        sha256: str,
        size: int,
        part_bytes: int,
        part_sha256: list[str],
    ) -> None:
        raise self._no_direct()

    def holds(self, key: str, *, sha256: str, size: int, part_bytes: int, part_sha256: list[str]) -> bool:
        path = self.local_path(key)
        if not path.is_file() or path.stat().st_size != size:
            return False
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
        return digest.hexdigest() == sha256

    def abort_upload(self, key: str, upload_id: str | None) -> None:
        return None

    def abandoned_uploads(self, prefix: str, older_than: datetime) -> list[tuple[str, str]]:
        return []
