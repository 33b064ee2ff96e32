"""The storage port: where artifacts' bytes live (SPEC §17, docs/storage.md).

Every artifact torchyard keeps (dataset and code archives, checkpoints, model and outputs
archives, pretrained weights) is an *object* named by a key such as
``checkpoints/<job id>/<checkpoint id>.pt``. Two implementations:

* :class:`~service.storage.files.FileStorage` (``TORCHYARD_STORAGE_URL`` unset): the key is
  a path under the data directory, exactly the layout the service always had; the API
  process moves the bytes.
* :class:`~service.storage.s3.S3Storage` (``s3://bucket/prefix``): the key is an object in
  the bucket; clients move the bytes themselves with short-lived presigned URLs
  (:attr:`ObjectStorage.direct`), and the API process moves none.

A direct upload is verified by the object store before it is visible: each presigned PUT
signs the sha256 of its bytes (``x-amz-checksum-sha256``), so the store refuses any other
bytes; an object of one part is thus its announced sha256, and one of several parts is
exactly the parts whose sha256 the uploader announced. This module knows nothing of the
database: the service layer records which key is current.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Protocol
from urllib.parse import quote


class StorageError(Exception):
    """The object store refused or failed an operation (a message for the operator)."""


class UploadIncomplete(Exception):
    """A direct upload cannot be completed as announced: parts missing, or an object whose
    size or checksum is not the announced one. The message says what."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: datetime | None = None


@dataclass(frozen=True)
class PartTarget:
    """Where one part of a direct upload goes: PUT its bytes to ``url`` with ``headers``."""

    number: int
    url: str
    headers: dict[str, str]
    size: int


@dataclass(frozen=True)
class UploadTargets:
    """A direct upload's presigned parts. ``upload_id`` is the store's multipart upload (None
    for a single PUT); ``done`` the parts already received (a resumed upload skips them)."""

    upload_id: str | None
    parts: list[PartTarget]
    done: list[int] = field(default_factory=list)


class ObjectStorage(Protocol):
    """What the service asks of an artifact store; see the module's docstring."""

    #: True when clients move the bytes (presigned URLs), False when the API does.
    direct: bool
    #: A description for logs and ``torchyard storage``: never a credential.
    description: str

    def local_path(self, key: str) -> Path | None:
        """The file of ``key`` where objects are files on this machine, else None."""
        ...

    def put_file(self, key: str, source: Path) -> None:
        """Store the file ``source`` as ``key``, replacing it; the file itself is left as it is."""
        ...

    def adopt_file(self, key: str, source: Path) -> None:
        """Store the file ``source`` as ``key`` and remove it (a rename where objects are files)."""
        ...

    def get_file(self, key: str, dest: Path) -> None:
        """Copy the object ``key`` into the file ``dest`` (written whole, then renamed)."""
        ...

    def head(self, key: str) -> ObjectInfo | None:
        """The object ``key``, or None when there is none."""
        ...

    def delete(self, key: str) -> None:
        """Remove the object ``key`` (nothing when there is none)."""
        ...

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object whose key starts with ``prefix``; how many."""
        ...

    def list_objects(self, prefix: str) -> Iterator[ObjectInfo]:
        """The objects whose keys start with ``prefix``."""
        ...

    def download_url(self, key: str, *, filename: str, content_type: str, ttl_s: int) -> str:
        """A URL that GETs ``key`` (Range supported) for ``ttl_s`` seconds, answering with
        ``filename`` as its attachment name (direct stores only)."""
        ...

    def begin_upload(
        self, key: str, *, sha256: str, size: int, part_bytes: int, part_sha256: list[str], ttl_s: int
    ) -> UploadTargets:
        """Presigned PUTs for a new upload of ``size`` bytes to ``key``: one when
        ``part_sha256`` has one entry, a multipart upload otherwise (direct stores only)."""
        ...

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
        """Fresh presigned PUTs for an upload begun earlier, with the parts already received."""
        ...

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
        """Make the upload one object, verified: raises :class:`UploadIncomplete` when a part
        is missing or the object is not the announced size and checksum."""
        ...

    def holds(self, key: str, *, sha256: str, size: int, part_bytes: int, part_sha256: list[str]) -> bool:
        """Whether ``key`` is already exactly the file described (its size and its checksum:
        the whole sha256, or for an object uploaded in parts, the checksum of the parts')."""
        ...

    def abort_upload(self, key: str, upload_id: str | None) -> None:
        """Drop an upload: its received parts, and the object of a single PUT."""
        ...

    def abandoned_uploads(self, prefix: str, older_than: datetime) -> list[tuple[str, str]]:
        """Multipart uploads under ``prefix`` begun before ``older_than``: (key, upload id)."""
        ...


def attachment(filename: str) -> str:
    """A ``Content-Disposition`` naming ``filename`` (an ASCII fallback and the UTF-8 name)."""
    ascii_name = re.sub(r"[^A-Za-z0-9._-]+", "_", filename)
    return f"attachment; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(filename, safe='')}"
