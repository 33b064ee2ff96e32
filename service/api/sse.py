"""Server-sent events framing: the ``text/event-stream`` bodies of a job's events and of
the job list, with keep-alive comments (the service layer yields items, not frames)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from service.db.engine import Database
from service.services.job_feed import LIST_KEEPALIVE_S, LIST_POLL_INTERVAL_S, job_changes
from service.services.stream_items import Cursor, Item
from service.services.streams import StreamHub, database_outage
from service.services.tokens import Principal

log = logging.getLogger(__name__)

KEEPALIVE_S = 15.0


@dataclass(frozen=True)
class EventFilter:
    """Which items an events subscriber wants beside status changes."""

    metrics: bool = True
    logs: bool = True
    ranks: frozenset[int] | None = None  # log streams of these ranks (None: all)
    agent: bool = True  # the agents' launcher logs

    def wants(self, item: Item) -> bool:
        if item.kind == "status":
            return True
        if item.kind == "metric":
            return self.metrics
        if not self.logs or item.stream is None:
            return False
        if item.stream.startswith("agent-"):
            return self.agent
        return self.ranks is None or item.data.get("rank") in self.ranks


def _sse(kind: str, payload: str, event_id: str | None = None) -> bytes:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {kind}\ndata: {payload}\n\n".encode()


async def _with_keepalive(source: AsyncIterator[bytes], interval: float) -> AsyncIterator[bytes]:
    """``source``'s chunks, plus a comment line whenever it is silent for ``interval``."""
    iterator = source.__aiter__()
    pending: asyncio.Task[bytes] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(iterator.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield b": keep-alive\n\n"
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield chunk
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, Exception):
                await pending
        aclose = getattr(iterator, "aclose", None)
        if aclose is not None:
            await aclose()


async def sse_events(
    hub: StreamHub, job_id: str, start: Cursor, wanted: EventFilter, *, keepalive: float = KEEPALIVE_S
) -> AsyncIterator[bytes]:
    """The ``text/event-stream`` body of ``GET /v1/jobs/{id}/events``."""

    async def events() -> AsyncIterator[bytes]:
        yield b"retry: 1000\n\n"
        delivered_final = False
        last = start
        try:
            async for item, cursor in hub.follow(job_id, start):
                last = cursor
                if wanted.wants(item):
                    yield _sse(item.kind, item.payload, cursor.encode())
                delivered_final = delivered_final or item.final
        except Exception as exc:
            if not database_outage(exc):
                raise
            # No "end": the client reconnects with Last-Event-ID (503 until the database is
            # back) and continues with no gap and no duplicate.
            log.warning("events of job %s: the database is unreachable, closing the stream", job_id)
            yield b": the database is unreachable; reconnect with Last-Event-ID\n\n"
            return
        if not delivered_final:
            # Resumed after the final status: say so, so the client stops reconnecting.
            yield _sse("end", json.dumps({"final": True, "cursor": last.encode()}))

    async for chunk in _with_keepalive(events(), keepalive):
        yield chunk


async def sse_job_list(
    db: Database,
    principal: Principal,
    *,
    interval: float = LIST_POLL_INTERVAL_S,
    keepalive: float = LIST_KEEPALIVE_S,
) -> AsyncIterator[bytes]:
    """Server-sent ``job`` events, one per changed job, until the client goes away."""
    yield b"retry: 2000\n\n"
    async for change in job_changes(db, principal, interval=interval, keepalive=keepalive):
        if change is None:
            yield b": keep-alive\n\n"
        else:
            yield _sse("job", json.dumps(change, separators=(",", ":")))
