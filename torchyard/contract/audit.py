"""The audit trail (docs/audit.md): the API's answer about the changes made through it.

Every change (sign-ins, tokens, jobs, sweeps, models, datasets, teams, users, webhooks...) is
one event: who made it, when, from where, what, and the status the API answered. The
service appends events and never updates or deletes them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field

# The media type of ``GET /v1/audit/export``: one event (JSON) per line, oldest first.
EXPORT_MEDIA_TYPE = "application/x-ndjson"


class AuditActor(BaseModel):
    """Who made a change; every field null when the request's token was refused."""

    name: str | None = Field(
        default=None, description="The user's name (or the token's, for a token of no user)."
    )
    token_id: str | None = Field(default=None, description="The id of the token the request carried.")
    token_name: str | None = Field(default=None, description="The name of that token.")
    role: str | None = Field(default=None, description="admin, user or worker.")


class AuditTarget(BaseModel):
    kind: str | None = Field(default=None, description="job, token, team, user, dataset, model...")
    id: str | None = Field(default=None, description="The target's id or name (a model: name:version).")


class AuditEventPublic(BaseModel):
    """One change made through the API."""

    id: int = Field(description="Increasing with each event written.")
    at: datetime
    actor: AuditActor
    via: str = Field(description="How the request was signed in: token, session (web UI cookie), oidc, none.")
    source: str | None = Field(default=None, description="The client's address as the API sees it.")
    action: str = Field(description="What was done, such as job.submit, token.revoke, team.update.")
    target: AuditTarget
    outcome: int = Field(description="The HTTP status the API answered (4xx: refused, nothing changed).")
    details: dict[str, Any] = Field(
        default_factory=dict, description="A few fields of the request (never a secret)."
    )


class AuditPage(BaseModel):
    items: list[AuditEventPublic]
    next_cursor: str | None = None
