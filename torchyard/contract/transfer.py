"""Direct transfers (docs/storage.md): with object storage, clients move artifact bytes
themselves with presigned URLs, and the API only says where.

An upload is two calls around the transfer:

1. ``POST <kind's upload route>`` with :class:`UploadRequest` (the file's sha256 and size,
   the part size the client cut it at and each part's sha256) → :class:`UploadPlan`.
   ``mode == "api"`` (file storage): PUT the body to the kind's API route as always.
   ``mode == "direct"``: PUT each part not yet ``done`` to its ``url`` with its
   ``headers`` (the part's signed sha256; the store refuses other bytes).
2. ``POST <the plan's complete_url>`` → the kind's usual answer, once the store holds
   the whole object, verified.

Asking again with the same request resumes: the plan lists the parts already received
(and fresh URLs, when the first ones expired).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from torchyard.contract.base import StrictModel

#: Part size clients cut uploads at: 64 MiB (S3 allows 5 MiB to 5 GiB, 10,000 parts).
PART_BYTES = 64 * 1024**2
MIN_PART_BYTES = 5 * 1024**2
MAX_PART_BYTES = 5 * 1024**3
MAX_PARTS = 10_000
_SHA256 = r"^[0-9a-f]{64}$"


class UploadRequest(StrictModel):
    sha256: str = Field(pattern=_SHA256, description="sha256 of the whole file, 64 hex digits.")
    size: int = Field(ge=0, description="The file's size in bytes.")
    part_bytes: int = Field(
        default=PART_BYTES,
        ge=MIN_PART_BYTES,
        le=MAX_PART_BYTES,
        description="Where the file is cut into parts.",
    )
    part_sha256: list[str] = Field(
        default_factory=list,
        max_length=MAX_PARTS,
        description="sha256 of each part, in order (one part for a file no larger than part_bytes).",
    )
    filename: str | None = Field(
        default=None, max_length=255, description="The file's name, where it matters."
    )


class PartUpload(BaseModel):
    number: int
    url: str
    headers: dict[str, str]
    size: int


class UploadPlan(BaseModel):
    mode: Literal["api", "direct"]
    upload_id: str | None = None
    put_url: str | None = Field(default=None, description='mode "api": the API route to PUT the body to.')
    complete_url: str | None = Field(
        default=None, description='mode "direct": POST here once every part is up.'
    )
    parts: list[PartUpload] = Field(default_factory=list)
    done: list[int] = Field(default_factory=list, description="Parts already received (skip them).")
    expires_in_s: int | None = None


def part_sizes(size: int, part_bytes: int) -> list[int]:
    """The sizes of the parts of a ``size``-byte file cut every ``part_bytes`` bytes (one
    part, possibly empty, for a file no larger than a part)."""
    if size <= part_bytes:
        return [size]
    full, rest = divmod(size, part_bytes)
    return [part_bytes] * full + ([rest] if rest else [])


def describe_file(path: Path, part_bytes: int = PART_BYTES, *, sha256: str | None = None) -> UploadRequest:
    """The upload request of a file: its size, sha256 and parts' sha256s (one read)."""
    size = path.stat().st_size
    part_bytes = max(part_bytes, -(-size // MAX_PARTS))
    whole = hashlib.sha256()
    parts: list[str] = []
    with open(path, "rb") as fh:
        for part_size in part_sizes(size, part_bytes):
            part = hashlib.sha256()
            left = part_size
            while left > 0:
                chunk = fh.read(min(1 << 20, left))
                if not chunk:
                    raise OSError(f"{path} shrank while it was read")
                part.update(chunk)
                whole.update(chunk)
                left -= len(chunk)
            parts.append(part.hexdigest())
    digest = whole.hexdigest()
    if sha256 is not None and digest != sha256:
        raise OSError(f"{path} changed: it hashes to {digest}, not {sha256}")
    return UploadRequest(sha256=digest, size=size, part_bytes=part_bytes, part_sha256=parts)
