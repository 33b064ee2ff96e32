"""The delivery loop of one API replica (docs/webhooks.md): webhook deliveries due are sent,
signed, and retried with backoff until their receiver answers 2xx or
``TORCHYARD_WEBHOOK_RETRY_S`` has passed since the event.

Each round claims a batch of due deliveries in a short transaction (PostgreSQL:
``FOR UPDATE SKIP LOCKED``, so replicas claiming at once take different rows) and pushes their
``next_attempt_at`` past the send's longest duration: no other replica sends them meanwhile.
The POSTs go out concurrently, outside any transaction; each outcome is then written back. A
replica that stops mid-send leaves the delivery due again once that time is past: a delivery
is sent at least once, and its ``X-Torchyard-Delivery`` id lets a receiver drop a repeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta

import httpx
from sqlalchemy import delete, select
from starlette.concurrency import run_in_threadpool

from service.config import Settings
from service.db.engine import Database, is_unavailable
from service.db.models import Webhook, WebhookDelivery
from service.db.types import utcnow
from service.services.webhooks import secret_of
from torchyard.contract.errors import ConflictError
from torchyard.contract.webhooks import (
    DELIVERY_HEADER,
    EVENT_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    sign,
)

log = logging.getLogger(__name__)

# Deliveries claimed (and sent at once) per round.
BATCH = 32
# The longest wait between two tries of a delivery.
MAX_BACKOFF_S = 3600.0
# Past the send's timeout, how long a claimed delivery stays another replica's.
CLAIM_MARGIN_S = 30.0
# How much of a receiver's answer is kept (characters).
RESPONSE_KEPT = 1000
# Delivered and failed deliveries are kept this long, then removed (checked hourly).
KEEP_FINISHED_S = 30 * 24 * 3600.0
_PRUNE_EVERY_S = 3600.0
USER_AGENT = "torchyard-webhooks/1"


@dataclass(frozen=True)
class Due:
    """A claimed delivery, with what sending it needs."""

    id: str
    url: str
    event: str
    body: str
    secret: str
    # The subscription and the job it is about: one such pair's deliveries go one at a time,
    # in the order they happened.
    key: tuple[str, str]


@dataclass(frozen=True)
class Outcome:
    ok: bool
    status: int | None
    response: str


def claim_due(db: Database, settings: Settings, limit: int = BATCH) -> list[Due]:
    """Up to ``limit`` due deliveries, claimed for this replica (their next try pushed past
    this send). A subscription whose secret cannot be decrypted fails its delivery at once."""
    now = utcnow()
    hold = now + timedelta(seconds=settings.webhook_timeout_s + CLAIM_MARGIN_S)
    claimed: list[Due] = []
    with db.transaction() as session:
        rows = session.execute(
            select(WebhookDelivery, Webhook)
            .join(Webhook, Webhook.id == WebhookDelivery.webhook_id)
            .where(WebhookDelivery.status == "pending", WebhookDelivery.next_attempt_at <= now)
            .order_by(WebhookDelivery.next_attempt_at, WebhookDelivery.created_at, WebhookDelivery.id)
            .limit(limit)
            .with_for_update(skip_locked=True, of=WebhookDelivery)
        ).all()
        for delivery, hook in rows:
            try:
                secret = secret_of(settings, hook)
            except ConflictError as exc:
                _finish(delivery, "failed", now)
                delivery.last_response = exc.message
                log.error("webhook %s: %s", hook.id, exc.message)
                continue
            delivery.next_attempt_at = hold
            claimed.append(
                Due(
                    delivery.id,
                    hook.url,
                    delivery.event,
                    delivery.body,
                    secret,
                    (hook.id, _job_of(delivery.body)),
                )
            )
    return claimed


async def send(http: httpx.AsyncClient, due: Due, timeout_s: float) -> Outcome:
    """POST the delivery, signed now; 2xx is delivered. At most ``timeout_s`` in all, and at
    most :data:`RESPONSE_KEPT` characters of the answer read."""
    stamp = str(int(time.time()))
    body = due.body.encode()
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        TIMESTAMP_HEADER: stamp,
        SIGNATURE_HEADER: sign(due.secret, stamp, body),
        EVENT_HEADER: due.event,
        DELIVERY_HEADER: due.id,
    }
    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream("POST", due.url, content=body, headers=headers) as answer:
                kept = b""
                async for chunk in answer.aiter_raw():
                    kept += chunk
                    if len(kept) >= RESPONSE_KEPT * 4:
                        break
                text = kept.decode(errors="replace")[:RESPONSE_KEPT]
                return Outcome(answer.is_success, answer.status_code, text)
    except TimeoutError:
        return Outcome(False, None, f"no answer within {timeout_s:g} s")
    except httpx.HTTPError as exc:
        return Outcome(False, None, f"{type(exc).__name__}: {exc}"[:RESPONSE_KEPT])


def record(db: Database, settings: Settings, due: Due, outcome: Outcome) -> None:
    """The try's outcome: delivered, retried later (the wait doubling from
    ``webhook_backoff_s``, at most an hour), or failed once ``webhook_retry_s`` has passed."""
    now = utcnow()
    with db.transaction() as session:
        delivery = session.get(WebhookDelivery, due.id, with_for_update=True)
        if delivery is None or delivery.status != "pending":
            return  # unsubscribed meanwhile
        delivery.attempts += 1
        delivery.last_attempt_at = now
        delivery.last_status = outcome.status
        delivery.last_response = outcome.response
        if outcome.ok:
            _finish(delivery, "delivered", now)
            return
        wait = min(settings.webhook_backoff_s * 2 ** min(delivery.attempts - 1, 30), MAX_BACKOFF_S)
        retry = now + timedelta(seconds=wait)
        if retry > delivery.created_at + timedelta(seconds=settings.webhook_retry_s):
            _finish(delivery, "failed", now)
            log.warning(
                "webhook delivery %s (%s) given up after %d tries: %s",
                delivery.id,
                delivery.event,
                delivery.attempts,
                outcome.status or outcome.response,
            )
        else:
            delivery.next_attempt_at = retry


def _finish(delivery: WebhookDelivery, status: str, now: datetime) -> None:
    delivery.status = status
    delivery.finished_at = now
    delivery.next_attempt_at = None


def prune_finished(db: Database, now: datetime | None = None) -> int:
    """Remove deliveries finished more than :data:`KEEP_FINISHED_S` ago."""
    cutoff = (now or utcnow()) - timedelta(seconds=KEEP_FINISHED_S)
    with db.transaction() as session:
        result = session.execute(delete(WebhookDelivery).where(WebhookDelivery.finished_at < cutoff))
        return int(getattr(result, "rowcount", 0) or 0)


class _Sender:
    """The replica's HTTP client for deliveries, made at the first one: most replicas never
    deliver, and a client's TLS context costs about 20 ms of CPU at every API start."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(max_connections=BATCH, max_keepalive_connections=8)
            self._client = httpx.AsyncClient(timeout=self._settings.webhook_timeout_s, limits=limits)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


async def deliver_round(db: Database, settings: Settings, sender: _Sender) -> int:
    """Claim, send and record one batch; how many were sent."""
    batch = await run_in_threadpool(claim_due, db, settings)
    if not batch:
        return 0
    http = sender.client()
    # Different jobs (and subscriptions) at once; one job's events to one subscription in
    # order: a receiver sees ``job.started`` before ``job.succeeded``.
    queues: dict[tuple[str, str], list[Due]] = {}
    for due in batch:
        queues.setdefault(due.key, []).append(due)

    async def in_order(queue: list[Due]) -> None:
        for due in queue:
            outcome = await send(http, due, settings.webhook_timeout_s)
            await run_in_threadpool(record, db, settings, due, outcome)

    await asyncio.gather(*(in_order(queue) for queue in queues.values()))
    return len(batch)


def _job_of(body: str) -> str:
    """The id of the job a delivery's body is about ("" for another event)."""
    try:
        job = json.loads(body).get("job")
    except (ValueError, AttributeError):
        return ""
    return str(job.get("id", "")) if isinstance(job, dict) else ""


async def run_deliveries(db: Database, settings: Settings, stop: asyncio.Event) -> None:
    """The loop, until ``stop`` is set: a round every ``webhook_poll_s`` (at once again after
    a full batch), across database outages."""
    last_prune = 0.0
    sender = _Sender(settings)
    try:
        while not stop.is_set():
            sent = 0
            try:
                sent = await deliver_round(db, settings, sender)
                if time.monotonic() - last_prune > _PRUNE_EVERY_S:
                    await run_in_threadpool(prune_finished, db)
                    last_prune = time.monotonic()
            except Exception as exc:  # keep the loop alive across database outages
                if is_unavailable(exc):
                    log.warning("webhook deliveries skipped: the database is unreachable")
                else:
                    log.exception("webhook delivery round failed")
            if sent < BATCH:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), settings.webhook_poll_s)
    finally:
        await sender.aclose()
