"""The audit trail (docs/audit.md), for admins: the changes made through the API, page by
page, or every one as JSON lines."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from typing import Any

from torchyard.apiclient.transport import Transport
from torchyard.contract.audit import AuditPage


def _filters(**values: Any) -> dict[str, Any]:
    return {
        name: value.isoformat() if isinstance(value, datetime) else value
        for name, value in values.items()
        if value is not None
    }


class AuditCalls:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def audit_events(
        self,
        *,
        actor: str | None = None,
        action: str | None = None,
        target: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
        limit: int = 50,
        cursor: str | None = None,
    ) -> AuditPage:
        """One page of events, newest first; ``action`` matches as a prefix (``job.``)."""
        params = _filters(
            actor=actor, action=action, target=target, since=since, until=until, limit=limit, cursor=cursor
        )
        return AuditPage.model_validate(self._transport.json("GET", "/v1/audit", params=params))

    def audit_export(
        self,
        *,
        actor: str | None = None,
        action: str | None = None,
        since: datetime | None = None,
        until: datetime | None = None,
    ) -> Iterator[bytes]:
        """The events as JSON lines, oldest first, as the API sends them (one event a line)."""
        params = _filters(actor=actor, action=action, since=since, until=until)
        with self._transport.stream(
            "GET", "/v1/audit/export", params=params, timeout=self._transport.read_timeout(None)
        ) as response:
            yield from response.iter_bytes()
