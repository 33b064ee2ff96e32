"""Webhooks (docs/webhooks.md): subscribe a URL to events of your jobs and sweeps, list and
delete subscriptions, and read what was delivered. To check a delivery where it arrives, see
:mod:`torchyard.webhooks`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchyard.apiclient.transport import Transport, segment
from torchyard.contract.webhooks import DeliveryList, WebhookCreated, WebhookPublic


class WebhookCalls:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def create_webhook(self, url: str, events: Sequence[str], *, team: str | None = None) -> WebhookCreated:
        """Subscribe ``url`` to ``events`` of your jobs and sweeps (of every job and sweep of
        ``team``, one of your teams, when given); the answer holds the signing secret, shown
        this once."""
        body: dict[str, Any] = {"url": url, "events": list(events)}
        if team is not None:
            body["team"] = team
        data = self._transport.json("POST", "/v1/webhooks", json=body)
        return WebhookCreated.model_validate(data)

    def list_webhooks(self) -> list[WebhookPublic]:
        data = self._transport.json("GET", "/v1/webhooks")
        return [WebhookPublic.model_validate(item) for item in data["items"]]

    def delete_webhook(self, webhook_id: str) -> WebhookPublic:
        data = self._transport.json("DELETE", f"/v1/webhooks/{segment(webhook_id)}")
        return WebhookPublic.model_validate(data)

    def webhook_deliveries(
        self, webhook_id: str, *, limit: int = 50, cursor: str | None = None
    ) -> DeliveryList:
        """One page of the subscription's deliveries, newest first."""
        params: dict[str, Any] = {"limit": limit}
        if cursor:
            params["cursor"] = cursor
        data = self._transport.json("GET", f"/v1/webhooks/{segment(webhook_id)}/deliveries", params=params)
        return DeliveryList.model_validate(data)
