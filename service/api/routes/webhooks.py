"""Webhook routes (docs/webhooks.md): subscribe, list, unsubscribe, and a subscription's
deliveries. A user sees their own subscriptions and their teams'; a team's is deleted by
whoever made it or an admin."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, status

from service.api.deps import CurrentUser, ReadSessionDep, SessionDep, SettingsDep
from service.api.routing import SessionScopedRoute
from service.schemas.webhooks import WebhookCreate
from service.services import webhooks as webhooks_service
from torchyard.contract.webhooks import DeliveryList, WebhookCreated, WebhookList, WebhookPublic

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"], route_class=SessionScopedRoute)


@router.post("", status_code=status.HTTP_201_CREATED)
def create_webhook(
    body: WebhookCreate, session: SessionDep, settings: SettingsDep, user: CurrentUser
) -> WebhookCreated:
    """Subscribe a URL to events of your jobs and sweeps, or with ``team`` of every job and
    sweep of one of your teams. 201 with the subscription and its signing ``secret``, shown
    this once. 422 for a URL that is not http(s), an unknown event, or a team you are not in
    (or ``default``, which shares nothing); 409 past 50 subscriptions."""
    return webhooks_service.create_webhook(session, settings, user, body.url, body.events, body.team)


@router.get("")
def list_webhooks(session: ReadSessionDep, user: CurrentUser) -> WebhookList:
    """Your subscriptions and your teams' (``team`` names the team), oldest first (never
    their secrets)."""
    rows = webhooks_service.list_webhooks(session, user)
    return WebhookList(items=webhooks_service.webhooks_public(session, rows))


@router.delete("/{webhook_id}")
def delete_webhook(webhook_id: str, session: SessionDep, user: CurrentUser) -> WebhookPublic:
    """Unsubscribe: nothing more is sent, pending deliveries included (404: not yours nor
    your team's; 403: a team's made by another user, which only they or an admin delete)."""
    return webhooks_service.delete_webhook(session, user, webhook_id)


@router.get("/{webhook_id}/deliveries")
def list_deliveries(
    webhook_id: str,
    session: ReadSessionDep,
    user: CurrentUser,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=500)] = None,
) -> DeliveryList:
    """The subscription's deliveries, newest first: event, status (pending, delivered,
    failed), tries, the last answer's status and start, the next try's time. Follow
    ``next_cursor`` for more."""
    items, next_cursor = webhooks_service.list_deliveries(
        session, user, webhook_id, limit=limit, cursor=cursor
    )
    return DeliveryList(items=items, next_cursor=next_cursor)
