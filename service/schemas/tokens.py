"""Token schemas. The secret is returned once, by the creation; no other answer carries it
or its hash."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from service.schemas.common import StrictModel
from service.states import Role


class TokenCreate(StrictModel):
    name: str = Field(min_length=1, max_length=200)
    role: Role = Field(strict=False)


class TokenCreated(BaseModel):
    id: str
    name: str
    role: Role
    token: str = Field(description="Shown once; only its hash is stored.")
    created_at: datetime


class TokenPublic(BaseModel):
    """A token as the admin sees it: never its secret nor its hash."""

    id: str
    name: str
    role: Role
    created_at: datetime
    last_used_at: datetime | None = Field(
        description="Last request made with the token, to within a minute (null: never used)."
    )
    revoked_at: datetime | None = Field(description="When it was revoked (null: still valid).")


class TokenList(BaseModel):
    items: list[TokenPublic]


class WhoAmI(BaseModel):
    id: str
    name: str
    role: Role
