"""Token routes (admin only): create, list and revoke; and ``whoami`` for any token."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, status

from service.api.deps import AdminUser, ReadSessionDep, SessionDep, get_principal
from service.api.routing import SessionScopedRoute
from service.db.models import Token, User
from service.schemas.tokens import TokenCreate, TokenList, WhoAmI
from service.services import tokens as tokens_service
from service.services.tokens import Principal
from torchyard.contract.responses import TokenCreated, TokenPublic

router = APIRouter(prefix="/v1/tokens", tags=["tokens"], route_class=SessionScopedRoute)


def _public(row: Token) -> TokenPublic:
    return TokenPublic(
        id=row.id,
        name=row.name,
        role=row.role,
        created_at=row.created_at,
        last_used_at=row.last_used_at,
        revoked_at=row.revoked_at,
    )


@router.post("", status_code=status.HTTP_201_CREATED)
def post_token(body: TokenCreate, session: SessionDep, _admin: AdminUser) -> TokenCreated:
    """Create a token (admin only)."""
    row, plain = tokens_service.issue_token(session, body.name, body.role, body.user)
    return TokenCreated(id=row.id, name=row.name, role=row.role, token=plain, created_at=row.created_at)


@router.get("")
def list_tokens(
    session: ReadSessionDep,
    _admin: AdminUser,
    include_revoked: Annotated[bool, Query(description="Also list revoked tokens.")] = True,
) -> TokenList:
    """Every token, oldest first (admin only): id, name, role, created, last used, revoked.
    Never the secret or its hash."""
    rows = tokens_service.list_tokens(session, include_revoked=include_revoked)
    return TokenList(items=[_public(row) for row in rows])


@router.delete("/{token_id}")
def revoke_token(token_id: str, session: SessionDep, _admin: AdminUser) -> TokenPublic:
    """Revoke a token (admin only, idempotent): every request carrying it is a 401 from now
    on, on every API replica. The last admin token that is not revoked cannot be (409)."""
    row = tokens_service.revoke_token(session, token_id)
    return _public(row)


whoami_router = APIRouter(prefix="/v1", tags=["tokens"], route_class=SessionScopedRoute)


@whoami_router.get("/whoami")
def whoami(principal: Annotated[Principal, Depends(get_principal)], session: ReadSessionDep) -> WhoAmI:
    """The identity behind the presented token (any role): its user and teams, if any."""
    user = session.get(User, principal.user_id) if principal.user_id else None
    return WhoAmI(
        id=principal.id,
        name=principal.name,
        role=principal.role,
        user=user.name if user is not None else None,
        teams=list(principal.team_names),
        email=user.email if user is not None else None,
    )
