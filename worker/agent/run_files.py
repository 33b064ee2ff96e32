"""Reading what a placement's ranks wrote since the last look: events and log files.

Positions only move when a batch is built, so a batch that is retried is the same batch,
and nothing more is read while the API is down.

Every file is opened once through :mod:`worker.agent.job_tree` (beneath the run's folder,
following no link, never blocking, regular files only) and read from that descriptor
afterwards: a name the run swaps for a link later changes nothing that is read.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from pydantic import ValidationError

from torchyard.contract.jobfile import EVENTS_FILE
from torchyard.contract.metrics import is_metric_name
from torchyard.contract.reports import FILE_STREAM_PREFIX
from torchyard.contract.run_events import RUN_EVENT, RUN_EVENT_TYPES, MetricEvent, ProgressEvent, ResultEvent
from worker.agent.job_tree import open_in

log = logging.getLogger("worker.agent.reporting")

# What one batch may carry; the API accepts more, this keeps requests quick.
MAX_BATCH_METRICS = 2000
MAX_BATCH_LOG_BYTES = 1 << 20
MAX_BATCH_LOG_CHUNKS = 500
# Unsent log bytes kept per stream while the API cannot be reached (an outage, a restart);
# beyond that, the oldest are dropped, with a note in the stream and in the agent's log.
# Metric points are never dropped: they are a few hundred bytes an iteration at most.
DEFAULT_LOG_BACKLOG_BYTES = 64 << 20
# One read of one log file. After U+FFFD replacement a chunk stays below the API's 256 KiB.
LOG_READ_BYTES = 64 * 1024
EVENTS_READ_BYTES = 256 * 1024
# The most bytes shipped of one file a script wrote under ./logs (a ``file-...`` stream);
# the rest stays on the node, with a note at the end of the stream.
MAX_LOG_FILE_BYTES = 16 << 20


def _utf8_complete_prefix(raw: bytes) -> int:
    """Length of ``raw`` without a trailing, still incomplete UTF-8 sequence."""
    for back in range(1, min(4, len(raw)) + 1):
        byte = raw[-back]
        if byte & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        if byte >= 0xF0:
            need = 4
        elif byte >= 0xE0:
            need = 3
        elif byte >= 0xC0:
            need = 2
        else:
            need = 1
        return len(raw) - back if back < need else len(raw)
    return len(raw)


def _clean_text(raw: bytes) -> str:
    # PostgreSQL text cannot hold NUL.
    return raw.decode("utf-8", errors="replace").replace("\x00", "\ufffd")


@dataclass
class _Tailed:
    """A file read as it grows, from the descriptor it was first opened with."""

    path: Path
    position: int = 0
    fh: BinaryIO | None = None
    refused: bool = False  # not a regular file (a link, a FIFO...): never read

    def open(self, root: Path | None) -> BinaryIO | None:
        if self.fh is None and not self.refused:
            try:
                self.fh = open_in(self.path, root)
            except FileNotFoundError:
                return None
            except OSError as exc:  # not a regular file (NotRegularFileError), or unreadable
                self.refused = True
                log.warning("not reading %s: %s", self.path.name, exc)
                return None
        return self.fh

    def size(self) -> int | None:
        if self.fh is None:
            return None
        try:
            return os.fstat(self.fh.fileno()).st_size
        except OSError:
            return None

    def read_from(self, root: Path | None, position: int, limit: int) -> bytes | None:
        fh = self.open(root)
        if fh is None:
            return None
        fh.seek(position)
        return fh.read(limit)

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None


@dataclass
class LogFile(_Tailed):
    stream: str = ""
    capped: bool = False  # a ./logs file past MAX_LOG_FILE_BYTES, its note sent


@dataclass
class Batch:
    metrics: list[dict[str, Any]] = field(default_factory=list)
    logs: list[dict[str, Any]] = field(default_factory=list)
    progress: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    tracking: dict[str, Any] | None = None
    log_bytes: int = 0
    full: bool = False

    def empty(self) -> bool:
        return not (self.metrics or self.logs or self.progress or self.result or self.tracking)

    def payload(self) -> dict[str, Any]:
        payload = {
            "metrics": self.metrics,
            "logs": self.logs,
            "progress": self.progress,
            "result": self.result,
        }
        if self.tracking is not None:
            payload["tracking"] = self.tracking
        return payload


def _int(value: Any, minimum: int = 0) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        return None
    return value


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _iso_time(value: Any) -> str:
    seconds = _finite(value)
    moment = datetime.fromtimestamp(seconds, UTC) if seconds is not None else datetime.now(UTC)
    return moment.isoformat()


def _metric_point(event: MetricEvent) -> dict[str, Any]:
    """A metric event as the report batch's point (``MetricIn``)."""
    return {
        "name": event.name,
        "value": event.value,
        "epoch": event.epoch,
        "step": event.step,
        "rank": event.rank,
        "time": _iso_time(event.time),
    }


def _progress(event: ProgressEvent) -> dict[str, Any]:
    """A progress event as the report batch's progress (``ProgressIn``)."""
    return {**event.model_dump(exclude={"type", "time"}), "time": _iso_time(event.time)}


def _result(event: ResultEvent) -> dict[str, Any]:
    """A result event as the report batch's result (``ResultIn``; the API checks an
    evaluation's figures)."""
    return event.model_dump(mode="json", exclude={"type", "time"})


def _script_metric(record: dict[str, Any], auto_steps: dict[tuple[str, int], int]) -> dict[str, Any] | None:
    """A line of a script's metrics file (``torchyard.run.log_metric`` or hand-written JSON):
    ``{"name", "value", "step"?, "epoch"?, "rank"?, "time"?}``. A missing step takes the next
    one of that name and rank, so repeated values are kept rather than dropped as duplicates.
    The MLflow endpoint's lines also carry ``occurrence`` (the value's ordinal at its step)
    where it is not 0."""
    name, value = record.get("name"), _finite(record.get("value"))
    rank = _int(record.get("rank", 0))
    epoch = _int(record.get("epoch", 0)) if record.get("epoch") is not None else 0
    occurrence = _int(record.get("occurrence", 0))
    if not is_metric_name(name) or value is None or rank is None or epoch is None or occurrence is None:
        return None
    assert isinstance(name, str)
    key = (name, rank)
    step = _int(record.get("step")) if record.get("step") is not None else auto_steps.get(key, -1) + 1
    if step is None:
        return None
    auto_steps[key] = max(step, auto_steps.get(key, -1))
    point = {
        "name": name,
        "value": value,
        "epoch": epoch,
        "step": step,
        "rank": rank,
        "time": _iso_time(record.get("time")),
    }
    if occurrence:
        point["occurrence"] = occurrence
    return point


class RunFileReader:
    """Tails ``events.jsonl``, a script's metrics files and the log files of one placement
    into batches."""

    def __init__(
        self,
        job_id: str,
        run_dir: Path,
        log_sources: Callable[[], list[tuple[str, Path]]],
        agent_log: Path,
        node_name: str,
        metric_sources: Callable[[], list[Path]] | None = None,
        *,
        max_log_backlog: int = DEFAULT_LOG_BACKLOG_BYTES,
        tracking_source: Callable[[], bytes | None] | None = None,
    ) -> None:
        self.job_id = job_id
        self.tracking_source = tracking_source
        self._tracking_sent: bytes | None = None
        self.max_log_backlog = max_log_backlog
        self.dropped_log_bytes = 0
        self.metric_sources = metric_sources
        self.metric_files: dict[Path, _Tailed] = {}
        self._auto_steps: dict[tuple[str, int], int] = {}
        # The latest step of each rank's own points (the system metrics' are not the script's).
        self._latest_steps: dict[int, int] = {}
        self.root = Path(run_dir)
        self.events_path = self.root / EVENTS_FILE
        self._events = _Tailed(self.events_path)
        self.log_sources = log_sources
        self.agent_stream = f"agent-{node_name}"
        self.agent_log = Path(agent_log)
        self.files: dict[Path, LogFile] = {}
        self._stream_offsets: dict[str, int] = {}
        self._rotation = 0
        self._skipping_long_line = False

    def collect(self, final: bool) -> Batch:
        batch = Batch()
        self._read_events(batch)
        self._read_script_metrics(batch)
        self._read_tracking(batch)
        self._refresh_sources()
        self._read_logs(batch, final)
        return batch

    def _read_tracking(self, batch: Batch) -> None:
        """A script's MLflow runs (``tracking.json``), whole, when they changed since the last batch."""
        if self.tracking_source is None:
            return
        snapshot = self.tracking_source()
        if snapshot is None or snapshot == self._tracking_sent:
            return
        self._tracking_sent = snapshot
        try:
            tracking = json.loads(snapshot)
        except ValueError:
            log.warning("job %s: ignoring an unreadable MLflow tracking snapshot", self.job_id)
            return
        if isinstance(tracking, dict):
            batch.tracking = tracking

    def _refresh_sources(self) -> None:
        try:
            sources = [*self.log_sources(), (self.agent_stream, self.agent_log)]
        except Exception:
            log.exception("job %s: listing log files failed", self.job_id)
            sources = [(self.agent_stream, self.agent_log)]
        for stream, path in sources:
            path = Path(path)
            if path not in self.files:
                self.files[path] = LogFile(path, stream=stream)
                self._stream_offsets.setdefault(stream, 0)

    def close(self) -> None:
        """Close every descriptor the reader holds (the placement has ended)."""
        for tailed in [self._events, *self.metric_files.values(), *self.files.values()]:
            tailed.close()

    def _read_events(self, batch: Batch) -> None:
        data = self._events.read_from(self.root, self._events.position, EVENTS_READ_BYTES)
        if data is None:
            return
        consumed = 0
        while consumed < len(data):
            end = data.find(b"\n", consumed)
            if end < 0:
                if consumed == 0 and len(data) == EVENTS_READ_BYTES:
                    # A line longer than any event: not ours to parse. Skip to its end.
                    log.warning("job %s: skipping an over-long line in %s", self.job_id, EVENTS_FILE)
                    self._skipping_long_line = True
                    consumed = len(data)
                break
            line = data[consumed:end]
            if self._skipping_long_line:
                self._skipping_long_line = False
            elif line.strip():
                if len(batch.metrics) >= MAX_BATCH_METRICS:
                    batch.full = True
                    break
                self._take_event(batch, line)
            consumed = end + 1
        self._events.position += consumed

    def _read_script_metrics(self, batch: Batch) -> None:
        if self.metric_sources is None:
            return
        for path in self.metric_sources():
            self.metric_files.setdefault(Path(path), _Tailed(Path(path)))
        for source in self.metric_files.values():
            if batch.full:
                return
            data = source.read_from(self.root, source.position, EVENTS_READ_BYTES)
            if data is None:
                continue
            source.position += self._take_metric_lines(batch, source.path, data)

    def _take_metric_lines(self, batch: Batch, path: Path, data: bytes) -> int:
        """Metric points of the complete lines in ``data``; the bytes consumed."""
        consumed = 0
        while consumed < len(data):
            end = data.find(b"\n", consumed)
            if end < 0:
                if consumed == 0 and len(data) == EVENTS_READ_BYTES:
                    log.warning("job %s: skipping an over-long line in %s", self.job_id, path.name)
                    consumed = len(data)
                break
            if len(batch.metrics) >= MAX_BATCH_METRICS:
                batch.full = True
                break
            line = data[consumed:end].strip()
            consumed = end + 1
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            point = _script_metric(record, self._auto_steps) if isinstance(record, dict) else None
            if point is None:
                log.warning("job %s: ignoring an invalid line in %s", self.job_id, path.name)
            else:
                batch.metrics.append(point)
                if not point["name"].startswith("sys."):
                    rank, step = point["rank"], point["step"]
                    self._latest_steps[rank] = max(step, self._latest_steps.get(rank, step))
        return consumed

    def latest_step(self, rank: int) -> int | None:
        """The latest step of the points read of ``rank`` (its system metrics' aside); None
        before any. Safe to ask from another thread."""
        return self._latest_steps.get(rank)

    def _take_event(self, batch: Batch, line: bytes) -> None:
        """One line of ``events.jsonl`` into the batch. A line that is not JSON, or an event
        of a known type that does not validate, is skipped with a warning; JSON that is not
        an object, or an object of another ``type``, is skipped silently."""
        try:
            record = json.loads(line)
        except ValueError:
            log.warning("job %s: ignoring a malformed line in %s", self.job_id, EVENTS_FILE)
            return
        kind = record.get("type") if isinstance(record, dict) else None
        if not isinstance(kind, str) or kind not in RUN_EVENT_TYPES:
            return
        try:
            event = RUN_EVENT.validate_python(record)
        except ValidationError:
            log.warning("job %s: ignoring an invalid %s event", self.job_id, kind)
            return
        if isinstance(event, MetricEvent):
            batch.metrics.append(_metric_point(event))
        elif isinstance(event, ProgressEvent):
            batch.progress = _progress(event)
        else:
            batch.result = _result(event)

    def _read_logs(self, batch: Batch, final: bool) -> None:
        files = list(self.files.values())
        if not files:
            return
        self._rotation = (self._rotation + 1) % len(files)
        files = files[self._rotation :] + files[: self._rotation]
        while True:
            progressed = False
            for source in files:
                budget = MAX_BATCH_LOG_BYTES - batch.log_bytes
                if budget <= 0 or len(batch.logs) >= MAX_BATCH_LOG_CHUNKS:
                    batch.full = True
                    return
                if self._read_log(batch, source, min(LOG_READ_BYTES, budget), final):
                    progressed = True
            if not progressed:
                return

    def backlog(self) -> int:
        """Log bytes written but not yet read into a batch, over every stream."""
        self._refresh_sources()
        total = 0
        for source in list(self.files.values()):
            source.open(self.root)
            size = source.size()
            if size is not None:
                total += max(0, size - source.position)
        return total

    def _drop_backlog(self, batch: Batch, source: LogFile, size: int) -> None:
        """Skip the oldest unsent bytes of a stream whose backlog is over the bound, and say so
        in the stream itself and in the agent's log."""
        unsent = size - source.position
        if unsent <= self.max_log_backlog:
            return
        dropped = unsent - self.max_log_backlog // 2
        first = source.position
        source.position += dropped
        self.dropped_log_bytes += dropped
        log.warning(
            "job %s: report buffer full: dropping %d unsent bytes of log stream %s (file bytes %d to %d "
            "of %s); the API was unreachable for longer than %d bytes of log lasts",
            self.job_id,
            dropped,
            source.stream,
            first,
            source.position,
            source.path.name,
            self.max_log_backlog,
        )
        note = (
            f"\n[torchyard agent: {dropped} bytes of this log were dropped here: the API could not be "
            f"reached and the agent keeps at most {self.max_log_backlog} unsent bytes per stream]\n"
        )
        offset = self._stream_offsets[source.stream]
        size_bytes = len(note.encode("utf-8"))
        batch.logs.append({"stream": source.stream, "offset": offset, "data": note})
        batch.log_bytes += size_bytes
        self._stream_offsets[source.stream] = offset + size_bytes

    def _cap(self, batch: Batch, source: LogFile, limit: int) -> int:
        """``limit`` within the bound of a ``./logs`` file stream (0 past it, noted once)."""
        if not source.stream.startswith(FILE_STREAM_PREFIX):
            return limit
        left = MAX_LOG_FILE_BYTES - source.position
        if left > 0:
            return min(limit, left)
        if not source.capped:
            source.capped = True
            log.warning(
                "job %s: log file %s is over %d bytes: the rest is not shipped",
                self.job_id,
                source.stream,
                MAX_LOG_FILE_BYTES,
            )
            self._append(
                batch,
                source,
                f"\n[torchyard agent: this file is longer than {MAX_LOG_FILE_BYTES} bytes: the rest is not shipped]\n",
            )
        return 0

    def _append(self, batch: Batch, source: LogFile, text: str) -> None:
        offset = self._stream_offsets[source.stream]
        size_bytes = len(text.encode("utf-8"))
        batch.logs.append({"stream": source.stream, "offset": offset, "data": text})
        batch.log_bytes += size_bytes
        self._stream_offsets[source.stream] = offset + size_bytes

    def _read_log(self, batch: Batch, source: LogFile, limit: int, final: bool) -> bool:
        limit = self._cap(batch, source, limit)
        if limit <= 0:
            return False
        fh = source.open(self.root)
        if fh is None:
            return False
        try:
            size = fh.seek(0, 2)
            if size < source.position:
                # Truncated under us: carry on from its new start, the stream keeps growing.
                source.position = 0
            self._drop_backlog(batch, source, size)
            fh.seek(source.position)
            raw = fh.read(limit)
        except OSError:
            return False
        if not raw:
            return False
        keep = len(raw) if final else _utf8_complete_prefix(raw)
        if keep == 0:
            return False
        text = _clean_text(raw[:keep])
        size_bytes = len(text.encode("utf-8"))
        offset = self._stream_offsets[source.stream]
        batch.logs.append({"stream": source.stream, "offset": offset, "data": text})
        batch.log_bytes += size_bytes
        self._stream_offsets[source.stream] = offset + size_bytes
        source.position += keep
        return keep == limit
