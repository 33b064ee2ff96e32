"""The audit trail (docs/audit.md): admins read every change made through the API, page by
page or as JSON lines. No route updates or deletes an event."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from service.api.deps import AdminUser, DatabaseDep, ReadSessionDep
from service.api.routing import SessionScopedRoute
from service.services import audit
from torchyard.contract.audit import EXPORT_MEDIA_TYPE, AuditPage
from torchyard.contract.errors import RequestValidationError

router = APIRouter(prefix="/v1/audit", tags=["audit"], route_class=SessionScopedRoute)

ActorQuery = Annotated[
    str | None,
    Query(max_length=200, description="Only this actor's events: a user's name, or a token's name or id."),
]
ActionQuery = Annotated[
    str | None,
    Query(
        max_length=64, description="Only actions starting with this: `job.` (every job action), `job.cancel`."
    ),
]
SinceQuery = Annotated[
    datetime | None, Query(description="Only events at or after this time (ISO 8601, with a zone).")
]
UntilQuery = Annotated[
    datetime | None, Query(description="Only events before this time (ISO 8601, with a zone).")
]


def _zoned(name: str, value: datetime | None) -> datetime | None:
    if value is not None and value.tzinfo is None:
        raise RequestValidationError(
            f"{name} needs a time zone, e.g. 2026-01-02T03:04:05Z", details={"field": name}
        )
    return value


@router.get("")
def list_audit(
    session: ReadSessionDep,
    _admin: AdminUser,
    actor: ActorQuery = None,
    action: ActionQuery = None,
    target: Annotated[
        str | None,
        Query(max_length=300, description="Only events about this target: its id or name, or `kind:id`."),
    ] = None,
    since: SinceQuery = None,
    until: UntilQuery = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=500)] = None,
) -> AuditPage:
    """Admin only: the changes made through the API, newest first (who, when, from where,
    what, and the status answered). Follow ``next_cursor`` for more, with the same filters."""
    items, next_cursor = audit.list_events(
        session,
        actor=actor,
        action=action,
        target=target,
        since=_zoned("since", since),
        until=_zoned("until", until),
        limit=limit,
        cursor=cursor,
    )
    return AuditPage(items=items, next_cursor=next_cursor)


@router.get(
    "/export",
    response_class=StreamingResponse,
    responses={200: {"content": {EXPORT_MEDIA_TYPE: {}}}},
)
def export_audit(
    db: DatabaseDep,
    _admin: AdminUser,
    actor: ActorQuery = None,
    action: ActionQuery = None,
    since: SinceQuery = None,
    until: UntilQuery = None,
) -> StreamingResponse:
    """Admin only: the events as JSON lines (``application/x-ndjson``), one event a line,
    oldest first: what operators archive (the API keeps every event; it deletes none)."""
    batches = audit.export_events(
        db, actor=actor, action=action, since=_zoned("since", since), until=_zoned("until", until)
    )

    def lines() -> Iterator[bytes]:
        for batch in batches:
            yield b"".join(event.model_dump_json().encode() + b"\n" for event in batch)

    return StreamingResponse(lines(), media_type=EXPORT_MEDIA_TYPE, headers={"Cache-Control": "no-store"})
