"""Dataset request and response schemas (docs/api.md shapes)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from service.schemas.common import StrictModel

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


class DatasetPublic(BaseModel):
    id: str
    name: str
    owner: str = Field(description="Id of the token that created the dataset.")
    source: Literal["upload", "path"]
    path: str | None = Field(default=None, description="The registered folder (path datasets only).")
    classes: list[str] = Field(description="Class names, sorted: the label order of trained models.")
    class_counts: dict[str, int]
    num_images: int
    size_bytes: int = Field(description="Total size of the image files.")
    sha256: str = Field(description="Content checksum: sha256 of the sorted manifest of image files.")
    created_at: datetime


class DatasetList(BaseModel):
    items: list[DatasetPublic]
    next_cursor: str | None = None
