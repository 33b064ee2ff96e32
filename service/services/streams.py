"""The feed of a job's live followers: what wakes them, without a thread or a database
connection per client.

One :class:`JobFeed` per followed job (per API process) polls the database with a
short-lived session in the threadpool, appends what is new (status changes from
``job_events``, metric points, log chunks) to a bounded in-memory buffer, and wakes
its subscribers, which are plain async generators. The database is the source of
truth: a follower on one API replica sees what arrived through another, at the next
poll. Writes made through this process wake the polls at once (an engine listener
notices inserts into the three tables), so local followers see them within
milliseconds, and idle feeds poll less often.

Positions are a :class:`~service.services.stream_items.Cursor` (what the items are and
how they are read: :mod:`service.services.stream_items`). A subscriber that falls behind
the buffer (or resumes from further back) catches up from the database in pages, then
joins the buffer again. The readers are the API's server-sent events
(:mod:`service.api.sse`) and ``logs?follow=true`` (:mod:`service.services.log_follow`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Insert, event
from starlette.concurrency import run_in_threadpool

from service.db.engine import Database, is_unavailable
from service.db.models import JobEvent, LogChunk, Metric
from service.services.stream_items import READ_LIMIT, Batch, Cursor, Heads, Item, read_batch, read_heads

__all__ = ["READ_LIMIT", "Cursor", "Item", "JobFeed", "StreamHub", "database_outage", "with_read_session"]

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.25
IDLE_POLL_INTERVAL_S = 1.0
IDLE_AFTER_S = 10.0
BUFFER_ITEMS = 5_000
BUFFER_LOG_BYTES = 16 * 1024 * 1024
FEED_LINGER_S = 5.0

# The tables whose inserts are a follower's items (a status change, a metric point, a log chunk).
_WATCHED_TABLES = frozenset(t.__tablename__ for t in (JobEvent, Metric, LogChunk))


def database_outage(exc: BaseException) -> bool:
    """``exc`` (or what caused it) says the database could not be reached."""
    seen: BaseException | None = exc
    while seen is not None:
        if is_unavailable(seen):
            return True
        seen = seen.__cause__
    return False


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
            heads: Heads = await run_in_threadpool(with_read_session, self.hub.db, read_heads, self.job_id)
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
        job_id, head, limit = self.job_id, self.head, READ_LIMIT
        batch: Batch = await run_in_threadpool(
            with_read_session, self.hub.db, lambda s: read_batch(s, job_id, head, limit=limit)
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


def with_read_session(db: Database, fn: Callable[..., Any], *args: Any) -> Any:
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
        event.listen(self.db.engine, "after_execute", self._after_execute)
        event.listen(self.db.engine, "checkin", self._on_checkin)
        self._listening = True

    async def close(self) -> None:
        if self._listening:
            event.remove(self.db.engine, "after_execute", self._after_execute)
            event.remove(self.db.engine, "checkin", self._on_checkin)
            self._listening = False
        for feed in list(self.feeds.values()):
            if feed.task is not None:
                feed.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await feed.task
        self.feeds.clear()

    def _after_execute(self, conn: Any, statement: Any, *_args: Any) -> None:
        # The statement as built (the ORM's flush and the reports' bulk inserts alike), not its SQL text.
        if isinstance(statement, Insert) and statement.table.name in _WATCHED_TABLES:
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
            with_read_session,
            self.db,
            lambda s, c=self.cursor, u=upto: read_batch(s, job_id, c, upto=u, limit=READ_LIMIT),
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
