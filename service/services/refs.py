"""What a user may type where a job or dataset id is expected: the id, the object's
name, or a unique prefix of the id (at least four characters, as git accepts).

Only the objects the principal may list are ever looked at (their user's, and for jobs
their teams' too; every one for an admin), in the query itself: another user's object
can neither be matched nor make a reference ambiguous, and is never named in an error.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Literal, TypeVar

from sqlalchemy import ColumnElement, Select, select
from sqlalchemy.orm import Session

from service.db.models import CodePackage, Dataset, Job, Sweep
from service.schemas.common import decode_cursor, encode_cursor
from service.services.ownership import owned, owns
from service.services.tokens import Principal
from torchyard.contract.errors import ConflictError, NotFoundError, RequestValidationError

MIN_PREFIX = 4
# Ids are 32 lowercase hex digits; a shorter run of hex digits may be the start of one.
_ID_PREFIX = re.compile(rf"[0-9a-fA-F]{{{MIN_PREFIX},31}}")
_SHOWN = 10

M = TypeVar("M", Job, Dataset, CodePackage, Sweep)
# What a user uploads and may delete: stored with its owner, soft-deleted.
Owned = TypeVar("Owned", Dataset, CodePackage)


class AmbiguousReferenceError(ConflictError):
    """A name or id prefix that matches more than one of the principal's objects."""

    code = "AmbiguousReferenceError"


def not_found_hint(ref: str) -> str:
    """What a not-found message adds for ``ref``: a few hex digits are too short a prefix."""
    if re.fullmatch(rf"[0-9a-fA-F]{{1,{MIN_PREFIX - 1}}}", ref):
        return f": an id prefix needs at least {MIN_PREFIX} characters"
    return ""


def comparable(ref: str) -> bool:
    """Whether ``ref`` may be compared with stored text at all: PostgreSQL refuses a NUL
    character in a query parameter, and no id or name holds one."""
    return "\x00" not in ref


def _describe(row: Job | Dataset) -> dict[str, Any]:
    described: dict[str, Any] = {"id": row.id, "name": row.name, "created_at": row.created_at.isoformat()}
    if isinstance(row, Job):
        described["status"] = row.status
    return described


def _ambiguous(kind: str, ref: str, by_name: bool, rows: list[Any]) -> AmbiguousReferenceError:
    shown = rows[:_SHOWN]
    listed = "; ".join(
        f"{r.id} ({r.name}" + (f", {r.status}" if isinstance(r, Job) else "") + ")" for r in shown
    )
    count = f"more than {_SHOWN}" if len(rows) > _SHOWN else str(len(rows))
    if by_name:
        how, hint = f"{count} {kind}s have this name", "give the id (or a unique start of it)"
    else:
        how, hint = f"{count} {kind} ids start with it", "give more characters of the id"
    return AmbiguousReferenceError(
        f"{kind} {ref!r} is ambiguous: {how}: {listed}; {hint}",
        details={"ref": ref, "candidates": [_describe(r) for r in shown]},
    )


def resolve(
    session: Session,
    model: type[M],
    visible: Sequence[ColumnElement[bool]],
    ref: str,
    kind: str,
) -> str | None:
    """The id of the one visible object named ``ref``, else of the one whose id starts
    with ``ref``; None when nothing matches. More than one match is a 409
    ``AmbiguousReferenceError`` listing the candidates.

    ``visible`` restricts the rows to those the principal may list. The caller has
    already looked ``ref`` up as a whole id.
    """
    if not comparable(ref):
        return None
    order = (model.created_at.desc(), model.id.desc())
    named = list(
        session.scalars(select(model).where(*visible, model.name == ref).order_by(*order).limit(_SHOWN + 1))
    )
    if len(named) == 1:
        return named[0].id
    if named:
        raise _ambiguous(kind, ref, True, named)
    if not _ID_PREFIX.fullmatch(ref):
        return None
    prefix = ref.lower()
    started = list(
        session.scalars(
            select(model).where(*visible, model.id.startswith(prefix)).order_by(*order).limit(_SHOWN + 1)
        )
    )
    if len(started) == 1:
        return started[0].id
    if started:
        raise _ambiguous(kind, ref, False, started)
    return None


def _listable(principal: Principal, model: type[Owned]) -> list[ColumnElement[bool]]:
    visible: list[ColumnElement[bool]] = [model.deleted_at.is_(None)]
    visible.extend(owned(principal, model.owner_id))
    return visible


def find_owned(
    session: Session,
    principal: Principal,
    model: type[Owned],
    ref: str,
    *,
    exact: bool,
    not_found: NotFoundError,
    lock: Literal["share", "update"] | None = None,
) -> Owned:
    """The upload ``ref`` names for the principal (its id; unless ``exact`` also its
    name or a unique id prefix), its row locked ``"share"`` or ``"update"`` when asked.
    Another user's, a deleted or an unknown one raises ``not_found``."""

    def by_id(wanted: str) -> Owned | None:
        stmt = select(model).where(model.id == wanted, model.deleted_at.is_(None))
        if lock is not None:
            stmt = stmt.with_for_update(read=lock == "share")
        return session.scalars(stmt).first()

    row = by_id(ref) if comparable(ref) else None
    if row is None or not owns(principal, row.owner_id):
        kind = "dataset" if model is Dataset else "code package"
        found = None if exact else resolve(session, model, _listable(principal, model), ref, kind)
        row = None if found is None else by_id(found)
        if row is None:
            raise not_found
    return row


def page_owned(
    session: Session, principal: Principal, model: type[Owned], *, limit: int, cursor: str | None
) -> tuple[list[Owned], str | None]:
    """The principal's uploads, newest first; ``cursor`` continues after the last row of
    the previous page."""
    return page_newest_first(
        session, model, select(model).where(*_listable(principal, model)), limit=limit, cursor=cursor
    )


def page_newest_first(
    session: Session, model: type[M], stmt: Select[M], *, limit: int, cursor: str | None
) -> tuple[list[M], str | None]:
    """One page of ``stmt``'s rows, newest first (created_at, then id); ``cursor`` continues
    after the last row of the previous page, and the next page's cursor is returned."""
    if cursor:
        created_iso, last_id = decode_cursor(cursor, 2)
        try:
            created = datetime.fromisoformat(created_iso)
        except (TypeError, ValueError) as exc:
            raise RequestValidationError("cursor is not one this service issued") from exc
        stmt = stmt.where(
            (model.created_at < created) | ((model.created_at == created) & (model.id < last_id))
        )
    rows = list(session.scalars(stmt.order_by(model.created_at.desc(), model.id.desc()).limit(limit + 1)))
    next_cursor = None
    if len(rows) > limit:
        rows = rows[:limit]
        next_cursor = encode_cursor(rows[-1].created_at.isoformat(), rows[-1].id)
    return rows, next_cursor
