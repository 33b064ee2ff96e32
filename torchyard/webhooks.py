"""Receiving torchyard's webhooks (docs/webhooks.md): check that a delivery was signed by the
service with the subscription's secret, and is not a replay. ::

    from torchyard.webhooks import WebhookVerificationError, verify

    def handle(secret: str, headers: Mapping[str, str], raw_body: bytes) -> None:
        try:
            event = verify(
                secret,
                headers["X-Torchyard-Timestamp"],
                raw_body,
                headers["X-Torchyard-Signature"],
            )
        except (KeyError, WebhookVerificationError):
            ...  # answer 400: not from torchyard, or too old
        print(event["event"], event.get("job", event.get("sweep")))

Pass the body exactly as received: the signature covers its bytes. A delivery may come
more than once (a retry after a lost answer); its ``X-Torchyard-Delivery`` id stays the
same. Plain Python: no part of the service, and only the standard library.
"""

from __future__ import annotations

from torchyard.contract.webhooks import (
    DEFAULT_TOLERANCE_S,
    DELIVERY_HEADER,
    EVENT_HEADER,
    EVENTS,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    WebhookVerificationError,
    sign,
    verify,
)

__all__ = [
    "DEFAULT_TOLERANCE_S",
    "DELIVERY_HEADER",
    "EVENTS",
    "EVENT_HEADER",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "WebhookVerificationError",
    "sign",
    "verify",
]
