"""Dataset request and response schemas (docs/api.md shapes)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from service.schemas.common import StrictModel
from torchyard.contract.manifests import DatasetManifest
from torchyard.contract.responses import DatasetPublic
from torchyard.contract.transfer import UploadRequest

NAME_MAX = 200


class DatasetRegister(StrictModel):
    """Register a directory on shared storage (under an operator-configured root) as a dataset."""

    name: str = Field(min_length=1, max_length=NAME_MAX, description="A name for the dataset.")
    path: str = Field(
        min_length=1,
        max_length=4096,
        description="Absolute path of the folder on the service's file system, under one of "
        "TORCHYARD_DATASET_ROOTS.",
    )
    sample: int | None = Field(
        default=None,
        gt=0,
        description="Decode only this many images (at least one per class) instead of all of them: "
        "for very large datasets. Every file is still hashed.",
        json_schema_extra={"allowed": "> 0"},
    )


class DatasetUploadRequest(UploadRequest):
    """A direct upload of a dataset's archive (object storage, docs/storage.md): the archive's
    transfer, and what the dataset is, as the client computed it from the files."""

    name: str = Field(min_length=1, max_length=NAME_MAX, description="A name for the dataset.")
    manifest: DatasetManifest = Field(
        description="The dataset's files, content checksum and classes (the API checks the layout "
        "rules on it; each node that fetches the archive checks the files against it)."
    )


class DatasetList(BaseModel):
    items: list[DatasetPublic]
    next_cursor: str | None = None
