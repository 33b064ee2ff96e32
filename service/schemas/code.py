"""Code package response schemas (docs/script-jobs.md)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

NAME_MAX = 200


class CodePublic(BaseModel):
    id: str
    name: str
    owner: str = Field(description="Id of the token that uploaded the package.")
    sha256: str = Field(description="Content checksum: sha256 of the sorted manifest of its files.")
    size_bytes: int = Field(description="Total size of the files.")
    files: int = Field(description="Number of files.")
    created_at: datetime


class CodeList(BaseModel):
    items: list[CodePublic]
    next_cursor: str | None = None
