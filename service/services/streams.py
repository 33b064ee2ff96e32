"""Live followers of a job: server-sent events and ``logs?follow=true``, without a thread
or a database connection per client.

One :class:`JobFeed` per followed job (per API process) polls the database with a
short-lived session in the threadpool, appends what is new (status changes from
``job_events``, metric points, log chunks) to a bounded in-memory buffer, and wakes
its subscribers, which are plain async generators. The database is the source of
truth: a follower on one API replica sees what arrived through another, at the next
poll. Writes made through this process wake the polls at once (an engine listener
notices inserts into the three tables), so local followers see them within
milliseconds, and idle feeds poll less often.

Positions are a :class:`Cursor` of three sequence numbers (status, metric, log). Every
report of a job is written under the job's row lock, so within one job ``seq`` order
is commit order and "everything after this cursor" never skips a late commit. A
server-sent event's id is the cursor after that event (``s<seq>.m<seq>.l<seq>``): a
client that reconnects with ``Last-Event-ID`` resumes exactly after it, with no gap and
no duplicate. A subscriber that falls behind the buffer (or resumes from further back)
catches up from the database in pages, then joins the buffer again.

The final status of a job is always the last item: a poll that reaches it while more
metric points or log chunks are pending delivers those first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from sqlalchemy import event, func, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.db.engine import Database, is_unavailable
from service.db.models import Attempt, Job, JobEvent, LogChunk, Metric
from service.services.reports import (
    LogPiece,
    log_chunks_after,
    metric_points_after,
    read_log,
    resolve_attempt,
)
from service.states import JobStatus
from torchyard.contract.errors import RequestValidationError

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25
IDLE_POLL_INTERVAL_S = 1.0
IDLE_AFTER_S = 10.0
READ_LIMIT = 1000
BUFFER_ITEMS = 5_000
BUFFER_LOG_BYTES = 16 * 1024 * 1024
KEEPALIVE_S = 15.0
FEED_LINGER_S = 5.0
LOG_READ_BYTES = 256 * 1024

_CURSOR = re.compile(r"^s([0-9]{1,19})\.m([0-9]{1,19})\.l([0-9]{1,19})$")
_SEQ_MAX = 2**63 - 1  # seq columns are 64-bit
_WATCHED_INSERT = re.compile(r"^\s*INSERT\s+INTO\s+\"?(job_events|metrics|log_chunks)\b", re.IGNORECASE)


# --------------------------------------------------------------------------- positions and items


@dataclass(frozen=True)
class Cursor:
    """The last delivered ``seq`` of each kind (0: nothing yet)."""

    status: int = 0
    metric: int = 0
    log: int = 0

    def encode(self) -> str:
        return f"s{self.status}.m{self.metric}.l{self.log}"

    @classmethod
    def decode(cls, text: str | None) -> Cursor:
        """Parse a ``Last-Event-ID``; empty means the beginning."""
        if not text:
            return cls()
        match = _CURSOR.match(text.strip())
        seqs = [int(g) for g in match.groups()] if match else []
        if match is None or max(seqs) > _SEQ_MAX:
            raise RequestValidationError(
                f"Last-Event-ID {text[:80]!r} is not an event id of this service (s<n>.m<n>.l<n>)",
                details={"field": "Last-Event-ID"},
            )
        return cls(*seqs)

    def covers(self, other: Cursor) -> bool:
        """Whether this position is at or past ``other`` for every kind."""
        return self.status >= other.status and self.metric >= other.metric and self.log >= other.log

    def after(self, item: Item) -> Cursor:
        if item.seq <= getattr(self, item.kind):
            return self
        return replace(self, **{item.kind: item.seq})


@dataclass(frozen=True)
class Item:
    """One thing that happened to a job, in the order followers receive it."""

    kind: str  # "status", "metric" or "log"
    seq: int
    data: dict[str, Any]
    final: bool = False
    stream: str | None = None
    attempt: int | None = None
    offset: int = 0
    text: str = ""

    @property
    def weight(self) -> int:
        return len(self.text) + 64

    @cached_property
    def payload(self) -> str:
        """``data`` as JSON, encoded once however many followers send it."""
        return json.dumps(self.data, separators=(",", ":"), allow_nan=False)


@dataclass
class Batch:
    items: list[Item]
    cursor: Cursor
    drained: bool  # nothing more to read up to ``upto`` (or now)
    final: bool  # the job's final status is among the items


def _status_item(ev: JobEvent, job: Job | None) -> Item:
    status = JobStatus(ev.status)
    data: dict[str, Any] = {
        "seq": ev.seq,
        "status": ev.status,
        "message": ev.message,
        "at": ev.at.isoformat(),
    }
    if status is JobStatus.QUEUED and ev.message != "submitted":
        # Back in the queue: a restart after a retryable failure, or a preemption.
        data["requeued"] = True
    final = status.is_final()
    if final and job is not None:
        data["final"] = True
        data["failure"] = (
            None
            if job.failure_code is None
            else {
                "code": job.failure_code,
                "message": job.failure_message,
                "rank": job.failure_rank,
                "node": job.failure_node,
            }
        )
        data["best"] = job.best
        data["result"] = job.result
        data["model_sha256"] = job.model_sha256
    return Item("status", ev.seq, data, final=final)


def _metric_item(point: Any) -> Item:
    data = point.model_dump(mode="json")
    return Item("metric", point.seq, data)


def _log_item(piece: LogPiece) -> Item:
    rank = int(piece.stream.removeprefix("rank-")) if piece.stream.startswith("rank-") else None
    data = {
        "seq": piece.seq,
        "stream": piece.stream,
        "rank": rank,
        "attempt": piece.attempt,
        "offset": piece.offset,
        "text": piece.data,
    }
    return Item(
        "log",
        piece.seq,
        data,
        stream=piece.stream,
        attempt=piece.attempt,
        offset=piece.offset,
        text=piece.data,
    )


def read_batch(
    session: Session, job_id: str, after: Cursor, *, upto: Cursor | None = None, limit: int = READ_LIMIT
) -> Batch:
    """What happened to the job after ``after`` (and not past ``upto``), final status last.

    Status changes are read first: every metric point and log chunk committed before a
    final status is then visible to the reads that follow, so none is left behind it.
    """
    stmt = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.seq > after.status)
    if upto is not None:
        stmt = stmt.where(JobEvent.seq <= upto.status)
    events = list(session.scalars(stmt.order_by(JobEvent.seq).limit(limit)))
    metrics = metric_points_after(session, job_id, after.metric, None, limit)
    pieces = log_chunks_after(session, job_id, None, after.log, limit=limit)
    # A kind is exhausted when its read came back short, or reached ``upto``.
    drained = (
        len(events) < limit
        and (len(metrics) < limit or (upto is not None and metrics[-1].seq >= upto.metric))
        and (len(pieces) < limit or (upto is not None and pieces[-1].seq >= upto.log))
    )
    if upto is not None:
        metrics = [m for m in metrics if m.seq <= upto.metric]
        pieces = [p for p in pieces if p.seq <= upto.log]
    statuses: list[Item] = []
    final = False
    job = None
    for ev in events:
        if JobStatus(ev.status).is_final():
            if not drained:
                break  # the final status waits until everything before it is out
            job = job or session.get(Job, job_id)
            statuses.append(_status_item(ev, job))
            final = True
            break
        statuses.append(_status_item(ev, None))
    # Status changes before the data of the same poll, except the final one, which ends it.
    items = (
        [s for s in statuses if not s.final]
        + [_metric_item(m) for m in metrics]
        + [_log_item(p) for p in pieces]
    )
    items += [s for s in statuses if s.final]
    cursor = after
    for item in items:
        cursor = cursor.after(item)
    return Batch(items, cursor, drained, final)


@dataclass(frozen=True)
class Heads:
    cursor: Cursor  # the job's current last seq of each kind
    items: int  # how many items the job has so far
    final: bool  # its final status is recorded


def read_heads(session: Session, job_id: str) -> Heads:
    """Where the job's history ends now, how long it is, and whether it is over."""
    values = []
    count = 0
    for table in (JobEvent, Metric, LogChunk):
        last, n = session.execute(
            select(func.max(table.seq), func.count()).where(table.job_id == job_id)
        ).one()
        values.append(int(last or 0))
        count += int(n)
    job_status = session.scalar(select(Job.status).where(Job.id == job_id))
    final = job_status is not None and JobStatus(job_status).is_final()
    return Heads(Cursor(*values), count, final)


# --------------------------------------------------------------------------- the shared feed


@dataclass
class _Subscription:
    feed: JobFeed
    position: int  # absolute index of the next buffer item to read


@dataclass
class JobFeed:
    """The one poller of a job in this process, and its buffer of recent items."""

    hub: StreamHub
    job_id: str
    base: Cursor = field(default_factory=Cursor)  # position just before the first buffered item
    head: Cursor = field(default_factory=Cursor)  # position after the last buffered item
    done: bool = False  # the final status is buffered (or was before the feed started)
    items: deque[Item] = field(default_factory=deque)
    first_index: int = 0  # absolute index of items[0]
    log_bytes: int = 0
    subscribers: int = 0
    version: int = 0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    error: BaseException | None = None

    @property
    def end_index(self) -> int:
        return self.first_index + len(self.items)

    def _append(self, items: list[Item]) -> None:
        for item in items:
            self.items.append(item)
            self.log_bytes += item.weight
            self.head = self.head.after(item)
        while self.items and (len(self.items) > BUFFER_ITEMS or self.log_bytes > BUFFER_LOG_BYTES):
            dropped = self.items.popleft()
            self.log_bytes -= dropped.weight
            self.first_index += 1
            self.base = self.base.after(dropped)

    def _notify(self) -> None:
        self.version += 1
        self.changed.set()
        self.changed = asyncio.Event()

    async def run(self) -> None:
        try:
            heads: Heads = await run_in_threadpool(_with_read_session, self.hub.db, read_heads, self.job_id)
            if heads.items <= BUFFER_ITEMS // 2:
                # A short history is read into the buffer once: followers that start from
                # the beginning (the usual case) then need no database read of their own.
                await self._read_history()
            else:
                self.base = self.head = heads.cursor
                self.done = heads.final
            self.ready.set()
            await self._poll()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a database outage: subscribers see it and end
            if is_unavailable(exc):
                # An expected event (the database restarting): one line, no traceback.
                log.warning("follower poll of job %s stopped: the database is unavailable", self.job_id)
            else:
                log.exception("follower poll of job %s failed", self.job_id)
            self.error = exc
        finally:
            self.ready.set()
            self.done = True
            self._notify()
            self.hub._forget(self)

    async def _read_batch(self) -> Batch:
        batch: Batch = await run_in_threadpool(
            _with_read_session, self.hub.db, read_batch, self.job_id, self.head
        )
        return batch

    async def _read_history(self) -> None:
        while True:
            batch = await self._read_batch()
            self._append(batch.items)
            self.done = self.done or batch.final
            if batch.drained or self.done:
                break

    async def _poll(self) -> None:
        """Poll for new items until the job is final, or nobody followed it for a while."""
        last_news = time.monotonic()
        idle_since: float | None = None
        while not self.done:
            if self.subscribers == 0:
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > FEED_LINGER_S:
                    return
            else:
                idle_since = None
            interval = (
                IDLE_POLL_INTERVAL_S
                if time.monotonic() - last_news > IDLE_AFTER_S
                else self.hub.poll_interval
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), interval)
            self.wake.clear()
            if await self._read_news():
                last_news = time.monotonic()

    async def _read_news(self) -> bool:
        """Buffer what was stored since the last poll; whether there was anything."""
        news = False
        while True:
            batch = await self._read_batch()
            if batch.items:
                news = True
                self._append(batch.items)
                self.done = batch.final
                self._notify()
            if batch.drained or self.done:
                return news

    def subscribe(self) -> _Subscription:
        self.subscribers += 1
        return _Subscription(self, self.end_index)

    def unsubscribe(self) -> None:
        self.subscribers -= 1
        if self.subscribers <= 0 and self.done:
            self.hub._forget(self)


def _with_read_session(db: Database, fn: Callable[..., Any], *args: Any) -> Any:
    with db.read_session() as session:
        return fn(session, *args)


class StreamHub:
    """All job feeds of one API process."""

    def __init__(self, db: Database, *, poll_interval: float = POLL_INTERVAL_S) -> None:
        self.db = db
        self.poll_interval = poll_interval
        self.feeds: dict[str, JobFeed] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._nudge_pending = False
        self._listening = False

    # -- in-process wake-ups

    def start(self) -> None:
        """Listen for inserts made through this process's engine, to wake the polls at once."""
        self._loop = asyncio.get_running_loop()
        event.listen(self.db.engine, "after_cursor_execute", self._after_execute)
        event.listen(self.db.engine, "checkin", self._on_checkin)
        self._listening = True

    async def close(self) -> None:
        if self._listening:
            event.remove(self.db.engine, "after_cursor_execute", self._after_execute)
            event.remove(self.db.engine, "checkin", self._on_checkin)
            self._listening = False
        for feed in list(self.feeds.values()):
            if feed.task is not None:
                feed.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await feed.task
        self.feeds.clear()

    def _after_execute(self, conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if _WATCHED_INSERT.match(statement):
            conn.info["torchyard_stream_write"] = True

    def _on_checkin(self, _dbapi_conn: Any, record: Any) -> None:
        # A connection goes back to the pool after its transaction ended: what it wrote
        # is committed (or rolled back, which costs one empty poll).
        if record.info.pop("torchyard_stream_write", False):
            self.nudge()

    def nudge(self) -> None:
        """Wake every feed's poll now (callable from any thread)."""
        loop = self._loop
        if loop is None or self._nudge_pending:
            return
        self._nudge_pending = True
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(self._wake_all)

    def _wake_all(self) -> None:
        self._nudge_pending = False
        for feed in self.feeds.values():
            feed.wake.set()

    # -- feeds

    def feed(self, job_id: str) -> JobFeed:
        feed = self.feeds.get(job_id)
        if feed is None or (
            feed.done and feed.task is not None and feed.task.done() and feed.error is not None
        ):
            feed = JobFeed(self, job_id)
            self.feeds[job_id] = feed
            feed.task = asyncio.get_running_loop().create_task(feed.run(), name=f"feed-{job_id}")
        return feed

    def _forget(self, feed: JobFeed) -> None:
        if self.feeds.get(feed.job_id) is feed and (feed.subscribers <= 0 or feed.error is not None):
            del self.feeds[feed.job_id]

    async def follow(self, job_id: str, start: Cursor) -> AsyncGenerator[tuple[Item, Cursor], None]:
        """Every item of the job after ``start``, each with the cursor after it, ending with
        the final status (immediately, with nothing, if ``start`` is already past it)."""
        feed = self.feed(job_id)
        sub = feed.subscribe()
        # Scan the buffer from its start: items up to ``start`` are skipped by their seq.
        sub.position = feed.first_index
        reader = _FeedReader(self.db, job_id, sub, start)
        try:
            await feed.ready.wait()
            while not reader.finished:
                if feed.error is not None:
                    raise RuntimeError("the database could not be read") from feed.error
                source = reader.catch_up() if reader.behind() else reader.scan_buffer()
                async with contextlib.aclosing(source):
                    async for item in source:
                        yield item, reader.cursor
        finally:
            feed.unsubscribe()


class _FeedReader:
    """One follower's place in a job's items: the cursor after the last item delivered and
    its subscription to the feed's buffer."""

    def __init__(self, db: Database, job_id: str, sub: _Subscription, start: Cursor) -> None:
        self.db = db
        self.job_id = job_id
        self.sub = sub
        self.feed = sub.feed
        self.cursor = start
        self.finished = False  # the final status was delivered, or the feed ended

    def _deliver(self, item: Item) -> None:
        self.cursor = self.cursor.after(item)
        self.finished = item.final

    def behind(self) -> bool:
        """Whether items between the cursor and the buffer's start are missing from the buffer."""
        return not self.cursor.covers(self.feed.base) or self.sub.position < self.feed.first_index

    async def catch_up(self) -> AsyncGenerator[Item, None]:
        """Items from the database up to the buffer's start."""
        upto = self.feed.base
        job_id = self.job_id
        batch = await run_in_threadpool(
            _with_read_session,
            self.db,
            lambda s, c=self.cursor, u=upto: read_batch(s, job_id, c, upto=u),
        )
        for item in batch.items:
            self._deliver(item)
            yield item
            if item.final:
                return
        if batch.drained:
            # Nothing left up to the buffer's start: continue in the buffer.
            cursor = self.cursor
            self.cursor = Cursor(
                max(cursor.status, upto.status),
                max(cursor.metric, upto.metric),
                max(cursor.log, upto.log),
            )
            self.sub.position = self.feed.first_index

    async def scan_buffer(self) -> AsyncGenerator[Item, None]:
        """The buffered items not yet delivered; at the end of the buffer, waits for more
        (or ends the follow if the feed is done)."""
        feed, sub = self.feed, self.sub
        index = max(sub.position, feed.first_index)
        version = feed.version
        changed = feed.changed
        while index < feed.end_index:
            item = feed.items[index - feed.first_index]
            index += 1
            if item.seq <= getattr(self.cursor, item.kind):
                continue  # already delivered (a resume from inside the buffer)
            self._deliver(item)
            sub.position = index
            yield item
            if item.final or sub.position < feed.first_index:
                return  # the end, or evicted while we were yielding: catch up from the database
        sub.position = index
        if feed.done:
            if feed.error is not None:
                # Cut the stream (no "end"): the client reconnects and resumes.
                raise RuntimeError("the database could not be read") from feed.error
            self.finished = True
            return
        if feed.version == version:
            await changed.wait()


# --------------------------------------------------------------------------- server-sent events


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
            if not _database_outage(exc):
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


# --------------------------------------------------------------------------- logs?follow=true


@dataclass(frozen=True)
class LogTarget:
    """Which log a text follower reads: a stream name (``rank-N``, ``agent``, ``agent-<node>``),
    pinned to one attempt or following the job's latest."""

    rank: int | None
    stream: str | None
    attempt: int | None


def _open_log(
    session: Session, job_id: str, target: LogTarget, attempt_number: int | None
) -> tuple[int | None, str | None]:
    from service.services.reports import resolve_stream

    job = session.get_one(Job, job_id)
    attempt = resolve_attempt(session, job, attempt_number if attempt_number is not None else target.attempt)
    stream = resolve_stream(session, job, attempt, rank=target.rank, stream=target.stream)
    return (attempt.number if attempt is not None else None), stream


def _read_log(
    session: Session, job_id: str, attempt_number: int, stream: str, offset: int
) -> tuple[bytes, int, bool]:
    job = session.get_one(Job, job_id)
    attempt = session.scalars(
        select(Attempt).where(Attempt.job_id == job_id, Attempt.number == attempt_number)
    ).one()
    piece = read_log(session, job, attempt, stream, offset, LOG_READ_BYTES)
    return piece.data, piece.next_offset, piece.complete


async def follow_log(
    hub: StreamHub,
    job_id: str,
    target: LogTarget,
    offset: int,
    resolved: tuple[int | None, str | None] | None = None,
) -> AsyncIterator[bytes]:
    """One log stream's bytes from ``offset`` as they arrive, until the job is final and
    every chunk is out (or, pinned to an attempt, until that attempt has ended).
    Following the latest attempt, a retried job's next attempt is followed from its start.
    ``resolved`` is the (attempt number, stream name) the caller already looked up."""
    db = hub.db
    feed = hub.feed(job_id)
    await feed.ready.wait()
    # Live items after this point come from the feed; what came before, from the database.
    live = hub.follow(job_id, feed.head)
    opened: tuple[int | None, str | None]
    if resolved is None:
        opened = await run_in_threadpool(_with_read_session, db, _open_log, job_id, target, None)
    else:
        opened = resolved
    reader = _LogReader(db, job_id, target, opened, offset)
    try:
        # A database outage cuts the body (no clean end, which would read as "complete"): the
        # follower asks again from the offset it reached.
        async for data in _follow_log_body(reader, live, target):
            yield data
    finally:
        await live.aclose()


def _database_outage(exc: BaseException) -> bool:
    """``exc`` (or what caused it) says the database could not be reached."""
    seen: BaseException | None = exc
    while seen is not None:
        if is_unavailable(seen):
            return True
        seen = seen.__cause__
    return False


async def _follow_log_body(
    reader: _LogReader, live: AsyncGenerator[tuple[Item, Cursor], None], target: LogTarget
) -> AsyncIterator[bytes]:
    """What the follower reads: the stored text, then live pieces until the end."""
    async for data in reader.read_stored():
        yield data
    if reader.ended and target.attempt is not None:
        return
    async for item, _cursor in live:
        if item.kind == "status":
            async for data in reader.on_status(item):
                yield data
            if reader.stopped:
                return
            continue
        piece = reader.live_piece(item)
        if piece is not None:
            yield piece


class _LogReader:
    """Where a log follower stands: the attempt and stream it reads, and the byte offset."""

    def __init__(
        self,
        db: Database,
        job_id: str,
        target: LogTarget,
        resolved: tuple[int | None, str | None],
        offset: int,
    ) -> None:
        self.db = db
        self.job_id = job_id
        self.target = target
        self.attempt, self.stream = resolved
        self.position = offset
        self.ended = False  # the attempt is over and nothing more will come
        self.stopped = False  # the follow is over

    async def read_stored(self) -> AsyncIterator[bytes]:
        """The stream from ``position`` to what is stored now; sets ``ended`` when the
        attempt is over and nothing more will come."""
        while self.attempt is not None and self.stream is not None:
            data, self.position, complete = await run_in_threadpool(
                _with_read_session, self.db, _read_log, self.job_id, self.attempt, self.stream, self.position
            )
            if data:
                yield data
            if len(data) < LOG_READ_BYTES:
                self.ended = complete
                return

    async def on_status(self, item: Item) -> AsyncIterator[bytes]:
        """A status change: the rest of the log if the follow ends here, or the start of a
        newer attempt's log when following the latest attempt."""
        status = item.data.get("status")
        if item.final or (self.target.attempt is not None and status == JobStatus.QUEUED):
            self.stopped = True
            async for data in self.read_stored():
                yield data
            return
        if self.target.attempt is None and status in (JobStatus.SCHEDULED, JobStatus.RUNNING):
            newer, new_stream = await run_in_threadpool(
                _with_read_session, self.db, _open_log, self.job_id, self.target, None
            )
            if newer != self.attempt or (new_stream is not None and self.stream is None):
                if self.attempt is not None and newer != self.attempt:
                    self.position = 0  # a retry: its streams start afresh
                self.attempt, self.stream = newer, new_stream
                async for data in self.read_stored():
                    yield data

    def live_piece(self, item: Item) -> bytes | None:
        """The new bytes of a live log item of the followed stream, or None."""
        if (
            item.kind != "log"
            or self.stream is None
            or item.stream != self.stream
            or item.attempt != self.attempt
        ):
            return None
        raw = item.text.encode("utf-8")
        end = item.offset + len(raw)
        if end <= self.position:
            return None
        # Bytes that never arrived (a batch an agent had to drop) are skipped, as plain reads do.
        self.position = max(self.position, item.offset)
        piece = raw[self.position - item.offset :]
        self.position = end
        return piece
