from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, status
from pydantic import BaseModel, Field

from service.api.deps import AdminUser, SessionDep, get_principal
from service.api.routing import SessionScopedRoute
from service.schemas.common import StrictModel
from service.services.tokens import Principal, create_token
from service.states import Role

router = APIRouter(prefix="/v1/tokens", tags=["tokens"], route_class=SessionScopedRoute)


class TokenCreate(StrictModel):
    name: str = Field(min_length=1, max_length=200)
    role: Role = Field(strict=False)


class TokenCreated(BaseModel):
    id: str
    name: str
    role: Role
    token: str = Field(description="Shown once; only its hash is stored.")
    created_at: datetime


@router.post("", status_code=status.HTTP_201_CREATED)
def post_token(body: TokenCreate, session: SessionDep, _admin: AdminUser) -> TokenCreated:
    """Create a token (admin only)."""
    row, plain = create_token(session, body.name, body.role)
    session.commit()
    return TokenCreated(id=row.id, name=row.name, role=Role(row.role), token=plain, created_at=row.created_at)


whoami_router = APIRouter(prefix="/v1", tags=["tokens"], route_class=SessionScopedRoute)


class WhoAmI(BaseModel):
    id: str
    name: str
    role: Role


@whoami_router.get("/whoami")
def whoami(principal: Annotated[Principal, Depends(get_principal)]) -> WhoAmI:
    """The identity behind the presented token (any role)."""
    return WhoAmI(id=principal.id, name=principal.name, role=principal.role)
