"""Code package response schemas (docs/script-jobs.md)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from torchyard.contract.manifests import FolderManifest
from torchyard.contract.responses import CodePublic
from torchyard.contract.transfer import UploadRequest

NAME_MAX = 200


class CodeUploadRequest(UploadRequest):
    """A direct upload of a code package's archive (object storage, docs/storage.md): the
    archive's transfer, and its files as the client computed them."""

    name: str = Field(min_length=1, max_length=NAME_MAX, description="A name for the package.")
    manifest: FolderManifest = Field(
        description="The package's files and content checksum (each node that fetches the archive "
        "checks its files against it)."
    )


class CodeList(BaseModel):
    items: list[CodePublic]
    next_cursor: str | None = None
