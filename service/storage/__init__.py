"""Artifact storage: one port (:mod:`service.storage.base`), two implementations (files under
the data directory, or an S3 bucket), chosen by ``TORCHYARD_STORAGE_URL``."""

from __future__ import annotations

from pathlib import Path

from service.storage.base import ObjectStorage
from service.storage.files import FileStorage

_OPEN: dict[tuple[str | None, Path], ObjectStorage] = {}


def open_storage(storage_url: str | None, data_dir: Path) -> ObjectStorage:
    """The store of ``storage_url`` (None: files under ``data_dir``), one per process."""
    cache_key = (storage_url, Path(data_dir))
    found = _OPEN.get(cache_key)
    if found is None:
        if storage_url is None:
            found = FileStorage(Path(data_dir))
        else:
            from service.storage.s3 import S3Storage

            found = S3Storage(storage_url)
        _OPEN[cache_key] = found
    return found


def is_storage_credential(name: str) -> bool:
    """Whether an environment variable configures the object store's access (the standard
    AWS settings): the API's own, never passed to a worker it starts."""
    return name.startswith("AWS_") or name == "TORCHYARD_STORAGE_URL"


__all__ = ["FileStorage", "ObjectStorage", "is_storage_credential", "open_storage"]
