"""Token schemas. The secret is returned once, by the creation; no other answer carries it
or its hash."""

from __future__ import annotations

from pydantic import BaseModel, Field

from service.schemas.common import StrictModel
from service.states import Role
from torchyard.contract.responses import TokenPublic


class TokenCreate(StrictModel):
    name: str = Field(min_length=1, max_length=200)
    role: Role = Field(strict=False)
    user: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="The user the token acts for (docs/teams.md); default: a new user of the token's name "
        "in the team default.",
    )


class TokenList(BaseModel):
    items: list[TokenPublic]


class WhoAmI(BaseModel):
    id: str
    name: str
    role: Role
    user: str | None = None
    teams: list[str] = []
    # A user who signs in with the OpenID provider (docs/oidc.md): their email there.
    email: str | None = None
