"""Looking up a registered model's version by name and number (``name:version``, or
``latest``): what registration, scoring and an evaluation's submission share."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import ModelVersion
from service.services.tokens import Principal
from torchyard.contract.errors import NotFoundError, RequestValidationError

LATEST = "latest"


def parse_version(version: str) -> int | None:
    """``latest`` (None) or a positive version number; anything else is a 422."""
    if version == LATEST:
        return None
    # ASCII digits only: "²" is a digit to isdigit() that int() refuses, "١" one it takes.
    if not (version.isascii() and version.isdigit()) or len(version) > 9 or int(version) < 1:
        raise RequestValidationError(
            f"version must be a positive number or 'latest', not {version!r}", details={"field": "version"}
        )
    return int(version)


def get_version(session: Session, principal: Principal, name: str, version: str) -> ModelVersion:
    number = parse_version(version)
    stmt = select(ModelVersion).where(
        ModelVersion.owner_id.in_(principal.owners),
        ModelVersion.name == name,
        ModelVersion.deleted_at.is_(None),
    )
    if number is not None:
        stmt = stmt.where(ModelVersion.version == number)
    row = session.scalars(stmt.order_by(ModelVersion.version.desc()).limit(1)).first()
    if row is None:
        shown = f"{name}:{version}"
        raise NotFoundError(f"model version {shown!r} not found")
    return row


def parse_reference(reference: str) -> tuple[str, str]:
    """``name:version`` (or ``name``, meaning latest) as ``(name, version)``."""
    name, _, version = reference.partition(":")
    return name, version or LATEST
