"""Metrics CSV files of a script job's processes become its metrics (docs/script-jobs.md).

Two well-known loggers write their metrics as a CSV file, never through a tracking
server: Lightning's ``CSVLogger`` (``metrics.csv``: columns ``epoch``, ``step`` and one per
metric, rows sparse, the whole file rewritten with a wider header when a new metric
appears) and timm's ``train.py`` (``summary.csv``: ``epoch`` and a column per metric,
``train_loss``, ``eval_loss``, ``eval_top1``, ``lr``...). The TensorBoard tailer
(:class:`worker.agent.tensorboard_scalars.ScalarTailer`) finds files of these names in the
folders it walks and hands them to a :class:`CsvMetrics`, which reads, at each look, the
complete lines appended since the last one: every numeric cell is a point named by its
column (made a metric name), its step from the ``step`` column (else the epoch), its epoch
from the ``epoch`` column. The points are appended as JSON lines to ``csv.jsonl`` in the
agent's own metrics folder of the placement, which the reporter ships like the others.

The folder is the script's to write, so a file is read on the agent's terms, as event files
are: opened once through :mod:`worker.agent.job_tree` (regular files only, no link
followed, never blocking), read from that descriptor, at most :data:`MAX_BYTES_PER_POLL`
a look, a line over :data:`MAX_LINE_BYTES` ending the reading of that file (said once).
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from worker.agent.job_tree import NotRegularFileError, open_at

METRICS_FILE_NAME = "csv.jsonl"
# The file names read: Lightning's CSVLogger, timm's train.py.
CSV_NAMES = frozenset({"metrics.csv", "summary.csv"})
MAX_CSV_FILES = 50
# A header or row longer than this is no metrics file's: the file is not read on.
MAX_LINE_BYTES = 64 << 10
# At most this much of one file is read per look; a file written faster is caught up later.
MAX_BYTES_PER_POLL = 1 << 20
# Columns of a file read as metrics (the rest are said once and left out).
MAX_COLUMNS = 256
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_.:/-]")
_AXES = ("epoch", "step")


def column_metric_name(column: str) -> str | None:
    """A CSV column's metric name: spaces and other characters a name cannot hold become
    ``_``, at most 64 characters; None for an empty column name."""
    name = _NOT_IN_NAME.sub("_", column.strip())
    if not name:
        return None
    if not (name[0].isalnum() or name[0] == "_"):
        name = "_" + name
    return name[:64]


def _number(cell: str) -> float | None:
    cell = cell.strip()
    if not cell:
        return None
    try:
        value = float(cell)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _whole(cell: str | None) -> int | None:
    """An epoch or step cell (``3`` or ``3.0``) as a count; None when it is none."""
    value = _number(cell) if cell is not None else None
    if value is None or value < 0 or value != int(value) or value > 2**62:
        return None
    return int(value)


@dataclass
class CsvFile:
    """One metrics CSV file, opened once, and how far it was read."""

    fh: BinaryIO
    name: str  # as the job's log names it
    rank: int
    owner: Hashable  # what tells its folder from others (see MetricNames)
    folder: tuple[str, ...]  # its folder's path parts under the walked root, the root's name first
    inode: int
    position: int = 0
    header: bytes | None = None  # the header line as read, its line end included
    names: list[str | None] = field(default_factory=list)  # per column; None: not a metric
    epoch_column: int | None = None
    step_column: int | None = None
    rows_read: int = 0  # data rows read since the header was (re)read
    rows_done: int = 0  # data rows made points: a rewritten file's first ones are not again
    done: bool = False

    def rewritten(self) -> bool:
        """Whether the file now holds something else before the position: shorter than what
        was read, or another header (Lightning writes the whole file anew, a column wider)."""
        fd = self.fh.fileno()
        if os.fstat(fd).st_size < self.position:
            return True
        return self.header is not None and os.pread(fd, len(self.header), 0) != self.header

    def lines(self, job_log: logging.Logger) -> list[bytes]:
        """The complete lines appended since the last look (at most MAX_BYTES_PER_POLL of them)."""
        fd = self.fh.fileno()
        size = os.fstat(fd).st_size
        if size <= self.position:
            return []
        data = os.pread(fd, min(size - self.position, MAX_BYTES_PER_POLL), self.position)
        end = data.rfind(b"\n") + 1
        lines: list[bytes] = []
        read = 0
        for line in data[:end].splitlines(keepends=True):
            if len(line) > MAX_LINE_BYTES:
                break
            lines.append(line)
            read += len(line)
        if self.rewritten():
            return []  # rewritten as it was read: read again from its start at the next look
        if read < end or (not end and len(data) > MAX_LINE_BYTES):
            self.done = True
            job_log.warning(
                "metrics file %s is not read past byte %d: a line there is over %d bytes "
                "(not a metrics CSV file)",
                self.name,
                self.position + read,
                MAX_LINE_BYTES,
            )
        self.position += read
        return lines


class CsvMetrics:
    """The metrics CSV files of one placement, read as they grow."""

    def __init__(
        self,
        out: Path,
        job_log: logging.Logger,
        name_point: Callable[[CsvFile, str], str | None],
    ) -> None:
        self.out = out
        self.job_log = job_log
        # The metric name of a column's name in a file (None: not kept), from the tailer:
        # it tells apart one name coming from two folders for one rank.
        self.name_point = name_point
        self.files: dict[Hashable, CsvFile] = {}
        self._left_out: set[Hashable] = set()
        self._said_too_many = False

    def found(
        self,
        key: Hashable,
        dir_fd: int,
        name: str,
        shown: str,
        rank: int,
        owner: Hashable,
        folder: tuple[str, ...],
    ) -> None:
        """A file of a metrics CSV's name at ``name`` in ``dir_fd``: opened if new (or
        replaced by another file since), never through a link."""
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        known = self.files.get(key)
        if known is not None:
            if known.inode == st.st_ino:
                return
            known.fh.close()  # removed and written anew (Lightning removes an old one)
            del self.files[key]
        if key in self._left_out:
            return
        if len(self.files) >= MAX_CSV_FILES:
            if not self._said_too_many:
                self._said_too_many = True
                self.job_log.warning(
                    "metrics file %s is not read: at most %d metrics CSV files are", shown, MAX_CSV_FILES
                )
            return
        try:
            fh = open_at(dir_fd, name)
        except FileNotFoundError:
            return
        except NotRegularFileError:
            if len(self._left_out) < MAX_CSV_FILES:
                self._left_out.add(key)
                self.job_log.warning(
                    "metrics file %s is not read: it is not a regular file (a link, a FIFO or a device)",
                    shown,
                )
            return
        inode = os.fstat(fh.fileno()).st_ino
        self.files[key] = CsvFile(fh, shown, rank, owner, folder, inode)

    def poll(self) -> int:
        """Append the points of the lines written since the last look; how many."""
        lines: list[str] = []
        for file in list(self.files.values()):
            if not file.done:
                lines.extend(self._read(file))
        if lines:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            with open(self.out, "a", encoding="utf-8") as fh:
                fh.write("".join(lines))
        return len(lines)

    def close(self) -> None:
        for file in self.files.values():
            file.done = True
            file.fh.close()

    def _read(self, file: CsvFile) -> Iterator[str]:
        if file.rewritten():
            file.position, file.header, file.rows_read = 0, None, 0
        now = time.time()
        for raw in file.lines(self.job_log):
            text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if file.header is None:
                if text.strip():
                    file.header = raw
                    self._columns(file, text)
                continue
            if not text.strip():
                continue
            file.rows_read += 1
            if file.rows_read <= file.rows_done:
                continue  # read before the file was rewritten
            file.rows_done = file.rows_read
            yield from self._points(file, next(csv.reader([text])), now)

    def _columns(self, file: CsvFile, text: str) -> None:
        columns = next(csv.reader([text]), [])
        file.names, file.epoch_column, file.step_column = [], None, None
        for index, column in enumerate(columns):
            axis = column.strip().lower()
            if axis in _AXES:
                if axis == "epoch" and file.epoch_column is None:
                    file.epoch_column = index
                elif axis == "step" and file.step_column is None:
                    file.step_column = index
                file.names.append(None)
                continue
            name = column_metric_name(column) if index < MAX_COLUMNS else None
            if name is None and column.strip():
                self.job_log.warning(
                    "metrics file %s: its column %r is not read (%s)",
                    file.name,
                    column[:80],
                    f"at most {MAX_COLUMNS} columns are" if index >= MAX_COLUMNS else "no metric name",
                )
            file.names.append(name)

    def _points(self, file: CsvFile, cells: list[str], now: float) -> Iterator[str]:
        def cell(index: int | None) -> str | None:
            return cells[index] if index is not None and index < len(cells) else None

        epoch = _whole(cell(file.epoch_column))
        step = _whole(cell(file.step_column))
        if step is None:
            step = epoch if epoch is not None else file.rows_read - 1
        for index, base in enumerate(file.names[: len(cells)]):
            if base is None:
                continue
            value = _number(cells[index])
            if value is None:
                continue  # an empty cell (Lightning's rows are sparse), text, NaN
            name = self.name_point(file, base)
            if name is None:
                continue
            point = {
                "name": name,
                "value": value,
                "step": step,
                "epoch": epoch or 0,
                "rank": file.rank,
                "time": now,
            }
            yield json.dumps(point, separators=(",", ":")) + "\n"
