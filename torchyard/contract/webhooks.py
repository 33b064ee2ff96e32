"""Webhooks (docs/webhooks.md): the events, the headers of a delivery, how it is signed, and
the API's answers about subscriptions and their deliveries.

A delivery is a ``POST`` of a JSON body ``{"event", "job" or "sweep", "at"}`` with
``X-Torchyard-Timestamp: <unix seconds>`` and ``X-Torchyard-Signature: sha256=<hex>``, the
HMAC-SHA256 under the subscription's secret of ``<timestamp>.<body>``. The service signs
with :func:`sign`; a receiver checks with :func:`verify` (also :mod:`torchyard.webhooks`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

JOB_EVENTS = ("job.started", "job.succeeded", "job.failed", "job.cancelled", "job.preempted")
SWEEP_EVENTS = ("sweep.best_changed", "sweep.ended")
# Every event a subscription may name, in the order the docs list them.
EVENTS = JOB_EVENTS + SWEEP_EVENTS

TIMESTAMP_HEADER = "X-Torchyard-Timestamp"
SIGNATURE_HEADER = "X-Torchyard-Signature"
EVENT_HEADER = "X-Torchyard-Event"
# The delivery's id: the same on every retry of one event, so a receiver can drop repeats.
DELIVERY_HEADER = "X-Torchyard-Delivery"
SIGNATURE_PREFIX = "sha256="
# How old a delivery's timestamp :func:`verify` accepts by default (a replay is older).
DEFAULT_TOLERANCE_S = 300

DeliveryStatus = Literal["pending", "delivered", "failed"]


class WebhookVerificationError(ValueError):
    """A delivery that is not what the service signed, or was signed too long ago."""


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else value


def sign(secret: str | bytes, timestamp: int | str, body: str | bytes) -> str:
    """The ``X-Torchyard-Signature`` value of ``body`` sent at ``timestamp`` (unix seconds):
    ``sha256=`` and the hex HMAC-SHA256 under ``secret`` of ``<timestamp>.<body>``."""
    message = f"{timestamp}.".encode() + _as_bytes(body)
    return SIGNATURE_PREFIX + hmac.new(_as_bytes(secret), message, hashlib.sha256).hexdigest()


def verify(
    secret: str | bytes,
    timestamp: str | int,
    body: str | bytes,
    signature: str,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    *,
    now: float | None = None,
) -> dict[str, Any]:
    """Check a delivery as received: the raw ``body`` (the bytes, before any JSON parsing),
    the ``X-Torchyard-Timestamp`` and ``X-Torchyard-Signature`` headers, and the
    subscription's ``secret``. Returns the parsed body.

    Raises :class:`WebhookVerificationError` when the signature does not match (compared in
    constant time), or when the timestamp is more than ``tolerance_s`` seconds from ``now``
    (default: the current time): a delivery recorded and replayed later is refused.
    """
    try:
        sent_at = int(str(timestamp).strip())
    except ValueError:
        raise WebhookVerificationError(f"the timestamp {timestamp!r} is not unix seconds") from None
    current = time.time() if now is None else now
    if abs(current - sent_at) > tolerance_s:
        raise WebhookVerificationError(
            f"the timestamp is {abs(current - sent_at):.0f} s away from now (at most {tolerance_s:g} s "
            "accepted): a replayed or delayed delivery"
        )
    expected = sign(secret, sent_at, body)
    if not hmac.compare_digest(expected.encode(), (signature or "").strip().encode()):
        raise WebhookVerificationError("the signature does not match the body, timestamp and secret")
    try:
        payload = json.loads(body)
    except ValueError:
        raise WebhookVerificationError("the body is not JSON") from None
    if not isinstance(payload, dict):
        raise WebhookVerificationError("the body is not a JSON object")
    return payload


# --- the API's answers ------------------------------------------------------------------------


class WebhookPublic(BaseModel):
    """A subscription, as its owner sees it (never its secret)."""

    id: str
    url: str
    events: list[str] = Field(description="The events delivered to the URL.")
    owner: str = Field(description="Id of the token that subscribed.")
    team: str | None = Field(
        default=None,
        description="The team whose jobs and sweeps it receives (its name); null: its owner's own.",
    )
    created_at: datetime


class WebhookCreated(WebhookPublic):
    """A new subscription, with its signing secret: shown this once."""

    secret: str = Field(description="The HMAC-SHA256 signing secret of the deliveries; shown once.")


class WebhookList(BaseModel):
    items: list[WebhookPublic]


class DeliveryPublic(BaseModel):
    """One event sent (or being sent) to a subscription's URL."""

    id: str = Field(description="The delivery's id, sent as X-Torchyard-Delivery on every try.")
    webhook_id: str
    event: str
    status: DeliveryStatus
    attempts: int = Field(description="Tries made so far.")
    last_status: int | None = Field(default=None, description="The HTTP status of the last try's answer.")
    last_response: str | None = Field(
        default=None, description="The start of the last answer's body (or why no answer came)."
    )
    next_attempt_at: datetime | None = Field(
        default=None, description="When the next try is due (pending deliveries)."
    )
    created_at: datetime
    last_attempt_at: datetime | None = None
    finished_at: datetime | None = Field(default=None, description="When it was delivered or given up.")


class DeliveryList(BaseModel):
    items: list[DeliveryPublic]
    next_cursor: str | None = None
