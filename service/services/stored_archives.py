"""Archives of inputs kept as objects (docs/storage.md): datasets, code packages and
pretrained weights, whatever the store.

A dataset or code package uploaded straight to the object store, or received by the API
while the store is a bucket, is kept as the archive it came in (``archive_key``); a node
fetches it through a redirect, extracts it and checks the content checksum itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from service.storage import ObjectStorage
from service.storage.base import StorageError
from torchyard.contract.errors import NotFoundError, ServiceUnavailableError

log = logging.getLogger(__name__)

# Extensions of the archive formats a name may end with (the content decides the format).
_SUFFIXES = ("tar.gz", "tar.bz2", "tar.xz", "tgz", "zip", "tar")


@dataclass(frozen=True)
class StoredFile:
    """An object served to a node (``object_response``): where, what and under which name."""

    key: str
    path: Path | None
    sha256: str
    size: int
    filename: str


def archive_suffix(filename: str | None, default: str = "tar.gz") -> str:
    """The archive extension a file name ends with (``default`` when none)."""
    lower = (filename or "").lower()
    return next((s for s in _SUFFIXES if lower.endswith("." + s)), default)


def stored_file(storage: ObjectStorage, key: str, *, sha256: str, filename: str, what: str) -> StoredFile:
    """The object ``key`` as served to a node: 404 naming ``what`` when the store lost it."""
    try:
        info = storage.head(key)
    except StorageError as exc:
        raise ServiceUnavailableError(f"the object store did not answer: {exc}") from exc
    if info is None:
        raise NotFoundError(f"the archive of {what} is missing from the store")
    return StoredFile(key=key, path=storage.local_path(key), sha256=sha256, size=info.size, filename=filename)


def delete_object(storage: ObjectStorage, key: str) -> None:
    """Remove an object no row uses any more (a store that does not answer is logged, not raised:
    the row is gone already)."""
    try:
        storage.delete(key)
    except StorageError as exc:
        log.warning("could not remove %s from the object store: %s", key, exc)
