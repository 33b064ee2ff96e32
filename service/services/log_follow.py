"""``logs?follow=true``: one log stream's bytes as they arrive, read from the job's feed."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from service.db.engine import Database
from service.db.models import Attempt, Job
from service.services.log_reads import read_log, resolve_attempt
from service.services.stream_items import Cursor, Item
from service.services.streams import StreamHub, with_read_session
from service.states import PLACED_STATUSES, JobStatus

LOG_READ_BYTES = 256 * 1024


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
    from service.services.log_reads import resolve_stream

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
        opened = await run_in_threadpool(with_read_session, db, _open_log, job_id, target, None)
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
                with_read_session, self.db, _read_log, self.job_id, self.attempt, self.stream, self.position
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
        if self.target.attempt is None and status in PLACED_STATUSES:
            newer, new_stream = await run_in_threadpool(
                with_read_session, self.db, _open_log, self.job_id, self.target, None
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
