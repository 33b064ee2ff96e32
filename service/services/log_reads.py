"""Reading a job's logs back: its streams, a byte range of one, where a tail or a time
begins, and the chunks after a ``seq`` for followers.

Each stream (``rank-N``, ``agent-<node>``, a script's ``file-<node rank>/<path>``, the
service's own ``service``) is stored as chunks keyed by attempt/stream/byte offset
(:mod:`service.services.report_ingest`); offsets count UTF-8 bytes. No owner check here:
callers resolve the job for the principal first.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.orm import Session

from service.db.models import Attempt, Job, LogChunk, Node, Placement
from service.schemas.reports import LogStream, LogStreams
from service.states import LIVE_ATTEMPT_STATUSES
from torchyard.contract.errors import NotFoundError, RequestValidationError
from torchyard.contract.reports import file_stream_node_rank, is_stream_name

# Rows one log read looks at; chunks are small, a reader continues from X-Next-Offset.
_LOG_ROWS_PER_READ = 2000
# The stream of the service's own notes on a job (never one an agent may send).
SERVICE_STREAM = "service"


@dataclass(frozen=True)
class LogPiece:
    """A stored log chunk, for followers: ``data`` starts at byte ``offset`` of ``stream``."""

    seq: int
    attempt: int
    stream: str
    offset: int
    data: str


def log_chunks_after(
    session: Session,
    job_id: str,
    stream: str | None,
    after_seq: int,
    *,
    attempt_id: str | None = None,
    limit: int = 1000,
) -> list[LogPiece]:
    """Log chunks of the job with ``seq > after_seq``, oldest first: one stream, or all with None.

    Within a stream, chunks arrive in offset order, so concatenating ``data`` in seq order
    rebuilds the text. No owner check here: callers resolve the job first.
    """
    stmt = (
        select(LogChunk.seq, Attempt.number, LogChunk.stream, LogChunk.offset, LogChunk.data)
        .join(Attempt, Attempt.id == LogChunk.attempt_id)
        .where(LogChunk.job_id == job_id, LogChunk.seq > after_seq)
    )
    if stream is not None:
        stmt = stmt.where(LogChunk.stream == stream)
    if attempt_id is not None:
        stmt = stmt.where(LogChunk.attempt_id == attempt_id)
    rows = session.execute(stmt.order_by(LogChunk.seq).limit(limit)).all()
    return [
        LogPiece(seq=r.seq, attempt=r.number, stream=r.stream, offset=r.offset, data=r.data) for r in rows
    ]


def resolve_attempt(session: Session, job: Job, number: int | None) -> Attempt | None:
    """Attempt ``number`` of the job (404 if there is none), or its latest (None before any)."""
    stmt = select(Attempt).where(Attempt.job_id == job.id)
    if number is None:
        return session.scalars(stmt.order_by(Attempt.number.desc()).limit(1)).first()
    attempt = session.scalars(stmt.where(Attempt.number == number)).first()
    if attempt is None:
        raise NotFoundError(f"job {job.id!r} has no attempt {number}")
    return attempt


def resolve_stream(
    session: Session, job: Job, attempt: Attempt | None, *, rank: int | None, stream: str | None
) -> str | None:
    """The stored stream name a log request means: ``rank`` N, ``agent`` (node rank 0's
    agent), ``agent-<node>`` or ``rank-N``; rank 0 when neither is given. None when the
    attempt has no such stream yet (``agent`` before placement)."""
    world_size = job.node_count * job.process_count_per_node
    if rank is not None and stream is not None:
        raise RequestValidationError("give either rank or stream, not both")
    if stream is None:
        rank = 0 if rank is None else rank
        stream = f"rank-{rank}"
    elif stream == "agent":
        if attempt is None:
            return None
        node_name = session.scalars(
            select(Node.name)
            .join(Placement, Placement.node_id == Node.id)
            .where(Placement.attempt_id == attempt.id, Placement.node_rank == 0)
        ).first()
        return None if node_name is None else f"agent-{node_name}"
    elif stream == SERVICE_STREAM:
        return stream
    elif not is_stream_name(stream):
        raise RequestValidationError(
            f"stream {stream!r} is not a log stream: use rank-<N>, agent, agent-<node name>, "
            f"file-<node rank>/<path> or {SERVICE_STREAM}"
        )
    if stream.startswith("rank-") and int(stream.removeprefix("rank-")) >= world_size:
        raise RequestValidationError(
            f"the job has ranks 0..{world_size - 1}; there is no {stream}",
            details={"field": "rank", "allowed": f"0..{world_size - 1}"},
        )
    return stream


def _attempt_complete(job: Job, attempt: Attempt | None) -> bool:
    """Nothing more will be written for this attempt: it, or the whole job, has ended."""
    if job.status.is_final():
        return True
    return attempt is not None and attempt.status not in LIVE_ATTEMPT_STATUSES


def stream_end(session: Session, job_id: str, attempt_id: str, stream: str) -> int:
    """The byte offset a stream's next chunk starts at (0 for a stream with none yet)."""
    end = session.scalar(
        select(func.max(LogChunk.offset + LogChunk.size)).where(
            LogChunk.job_id == job_id, LogChunk.attempt_id == attempt_id, LogChunk.stream == stream
        )
    )
    return int(end or 0)


def start_offset(
    session: Session,
    job: Job,
    attempt: Attempt | None,
    stream: str | None,
    *,
    tail: int | None = None,
    since: datetime | None = None,
) -> int:
    """Where a log read with ``tail`` (the last lines) or ``since`` (text that arrived at or
    after a time) begins: a byte offset of ``stream``, 0 when neither is given."""
    if attempt is None or stream is None:
        return 0
    of_stream = (LogChunk.job_id == job.id, LogChunk.attempt_id == attempt.id, LogChunk.stream == stream)
    start = 0
    if since is not None:
        first = session.scalar(
            select(func.min(LogChunk.offset)).where(*of_stream, LogChunk.created_at >= since)
        )
        start = stream_end(session, job.id, attempt.id, stream) if first is None else int(first)
    if tail is not None:
        start = max(start, _tail_offset(session, of_stream, tail))
    return start


def _tail_offset(session: Session, of_stream: tuple[ColumnElement[bool], ...], lines: int) -> int:
    """The offset of the start of the last ``lines`` lines (a last line without its newline
    counts), reading the chunks from the end."""
    wanted = lines + 1  # newlines to pass: the one ending the last line, then one per line
    seen_text = False
    before: int | None = None
    while True:
        stmt = select(LogChunk.offset, LogChunk.data).where(*of_stream)
        if before is not None:
            stmt = stmt.where(LogChunk.offset < before)
        rows = session.execute(stmt.order_by(LogChunk.offset.desc()).limit(_LOG_ROWS_PER_READ)).all()
        if not rows:
            return 0
        for chunk_offset, data in rows:
            raw = data.encode("utf-8")
            end = len(raw)
            if not seen_text and raw:
                seen_text = True
                if not raw.endswith(b"\n"):
                    wanted -= 1  # the last line has no newline of its own
            while True:
                at = raw.rfind(b"\n", 0, end)
                if at < 0:
                    break
                wanted -= 1
                if wanted == 0:
                    return int(chunk_offset) + at + 1
                end = at
            before = chunk_offset


@dataclass(frozen=True)
class LogSlice:
    """Bytes of one stream from ``offset`` on; continue from ``next_offset``."""

    data: bytes
    offset: int
    next_offset: int
    stream: str | None
    attempt: int | None
    complete: bool


def read_log(
    session: Session,
    job: Job,
    attempt: Attempt | None,
    stream: str | None,
    offset: int,
    limit_bytes: int,
) -> LogSlice:
    """Up to ``limit_bytes`` of ``stream`` starting at byte ``offset``.

    ``complete`` is True when the attempt (or job) has ended and the reader is at the
    end of the stream: nothing more will come. Bytes that never arrived (a batch the
    agent had to drop) are skipped rather than waited for.
    """
    if attempt is None or stream is None:
        return LogSlice(b"", offset, offset, stream, None, _attempt_complete(job, attempt))
    of_stream = (
        LogChunk.job_id == job.id,
        LogChunk.attempt_id == attempt.id,
        LogChunk.stream == stream,
    )
    # Start at the chunk holding ``offset``: the last one that begins at or before it.
    first = select(func.max(LogChunk.offset)).where(*of_stream, LogChunk.offset <= offset).scalar_subquery()
    rows = session.execute(
        select(LogChunk.offset, LogChunk.size, LogChunk.data)
        .where(*of_stream, LogChunk.offset >= func.coalesce(first, 0))
        .order_by(LogChunk.offset)
        .limit(_LOG_ROWS_PER_READ)
    ).all()
    out = bytearray()
    start = position = offset
    for chunk_offset, size, data in rows:
        if chunk_offset + size <= position:
            continue
        if len(out) >= limit_bytes:
            break
        if chunk_offset > position:
            if out:
                break  # a gap: return the contiguous part; the next read skips it
            start = position = chunk_offset
        raw = data.encode("utf-8")
        piece = raw[position - chunk_offset : position - chunk_offset + limit_bytes - len(out)]
        out += piece
        position += len(piece)
    complete = _attempt_complete(job, attempt) and position >= stream_end(session, job.id, attempt.id, stream)
    return LogSlice(bytes(out), start, position, stream, attempt.number, complete)


def _stream_sort_key(name: str) -> tuple[int, int, str]:
    if name.startswith("rank-"):
        return (1, int(name.removeprefix("rank-")), "")
    node_rank = file_stream_node_rank(name)
    if node_rank is not None:
        return (2, node_rank, name)
    return (0, 0, name)


def list_streams(session: Session, job: Job, attempt: Attempt | None) -> LogStreams:
    """The attempt's log streams with their sizes: every rank and every node's agent log,
    including those that have not written anything yet."""
    if attempt is None:
        return LogStreams(attempt=None, complete=_attempt_complete(job, None), streams=[])
    sizes: dict[str, int] = {
        name: int(end)
        for name, end in session.execute(
            select(LogChunk.stream, func.max(LogChunk.offset + LogChunk.size))
            .where(LogChunk.job_id == job.id, LogChunk.attempt_id == attempt.id)
            .group_by(LogChunk.stream)
        ).all()
    }
    for global_rank in range(job.node_count * job.process_count_per_node):
        sizes.setdefault(f"rank-{global_rank}", 0)
    nodes: dict[int, str] = {
        node_rank: node_name
        for node_rank, node_name in session.execute(
            select(Placement.node_rank, Node.name)
            .join(Placement, Placement.node_id == Node.id)
            .where(Placement.attempt_id == attempt.id)
        ).all()
    }
    for node_name in nodes.values():
        sizes.setdefault(f"agent-{node_name}", 0)
    streams = []
    for name in sorted(sizes, key=_stream_sort_key):
        rank = int(name.removeprefix("rank-")) if name.startswith("rank-") else None
        node = name.removeprefix("agent-") if name.startswith("agent-") else None
        file_node = file_stream_node_rank(name)
        if file_node is not None:
            node = nodes.get(file_node)
        streams.append(LogStream(name=name, size=sizes[name], rank=rank, node=node))
    return LogStreams(attempt=attempt.number, complete=_attempt_complete(job, attempt), streams=streams)
