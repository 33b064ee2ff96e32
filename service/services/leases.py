"""Lease fencing: every write from a worker carries its placement's lease token.

A token that is unknown, belongs to another worker, is finished, or has expired is
stale: the write is refused with 409 ``StaleLeaseError`` and changes nothing.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import Node, Placement, utcnow
from service.services.tokens import Principal
from torchyard.errors import StaleLeaseError

LEASE_HEADER = "X-Torchyard-Lease"


def placement_for_lease(
    session: Session, principal: Principal, lease_token: str | None, *, for_update: bool = False
) -> Placement:
    """The live placement holding ``lease_token`` for this worker, or StaleLeaseError."""
    if not lease_token:
        raise StaleLeaseError(f"missing {LEASE_HEADER} header")
    stmt = (
        select(Placement)
        .join(Node, Node.id == Placement.node_id)
        .where(Placement.lease_token == lease_token, Node.token_id == principal.id)
    )
    if for_update:
        stmt = stmt.with_for_update(of=Placement)
    placement = session.scalars(stmt).first()
    if placement is None:
        raise StaleLeaseError("unknown lease token")
    if placement.status == "done":
        raise StaleLeaseError("the lease's placement is finished")
    if placement.lease_expires_at < utcnow():
        raise StaleLeaseError("the lease has expired")
    return placement
