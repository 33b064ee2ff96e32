"""Code package response schemas (docs/script-jobs.md)."""

from __future__ import annotations

from pydantic import BaseModel

from torchyard.contract.responses import CodePublic

NAME_MAX = 200


class CodeList(BaseModel):
    items: list[CodePublic]
    next_cursor: str | None = None
