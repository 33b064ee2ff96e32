"""TensorBoard scalars of a script job's processes become its metrics (docs/script-jobs.md).

A :class:`ScalarTailer` looks, about every second, for TensorBoard event files
(``*tfevents*``) under a placement's working copies and its ``outputs``/``logs`` folders,
reads what was appended to each, and appends the scalars as JSON lines to
``tensorboard.jsonl`` in the agent's own metrics folder of the placement: from there the
reporter ships them like every other metric line (exactly once, keyed by name, rank and
step). The tag is the metric's name (spaces become ``_``; a tag that still is not a metric
name is skipped, said once in the job's log), the event's step its step. A file under a
process's own working copy carries that process's rank; one under the shared folders (or a
``per_node`` command's copy) the node's first rank.

A metric is named as TensorBoard shows its series, so that none hides another (the API
keeps the first point of a name, rank and step):

* ``SummaryWriter.add_scalars("L", {"a": ..., "b": ...})`` writes each key's series to an
  event file of its own in ``<log dir>/L_a/``, ``L_b/``..., all with the tag ``L``: the
  scalars of tag ``T`` in a folder named ``<T with / as _>_<key>`` are the metric ``T/<key>``;
* when event files of two folders (two writers, ``runs/train`` and ``runs/val``, both
  logging ``loss``) give one name for one rank, the folder found later names its series
  (``val/loss``; its parent folders too, ``runs/val/loss``, if that name is taken as well),
  said once in the job's log (:class:`MetricNames`).

The MLflow endpoint's artifact folders (``outputs/mlflow/<run id>/artifacts``) are not
walked: event files there are copies ``mlflow.log_artifacts`` made, not series being
written. Nor is a file of the name of one already read for the rank (a writer names its
file by time, host and process: it is a copy, said once). The same walk finds the metrics CSV files of Lightning's ``CSVLogger`` and timm
(:mod:`worker.agent.csv_metrics`), named by the same rules.

Those folders are the script's to write, and the agent reading them is shared by every job
of the node, so an event file is read on the agent's terms:

* it is opened once, through :mod:`worker.agent.job_tree` (no link followed, never
  blocking, a regular file only: a FIFO, a device or a link named ``*tfevents*`` is left
  out, said once), and read from that descriptor as it grows;
* its records (TFRecord framing: a little-endian uint64 length, the masked CRC32C of the
  length, the data, the masked CRC32C of the data) are read by the tailer itself, only when
  complete: a record still being written waits for the next look, a length that fails its
  check ends the reading of that file (said once), a record over
  :data:`MAX_RECORD_BYTES` is skipped without being read (said once), and a look reads at
  most :data:`MAX_BYTES_PER_POLL` of a file; so the memory a look takes is about that of one
  record, whatever the file claims or its size.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
import struct
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from torchyard.contract.metrics import is_metric_name
from worker.agent import csv_metrics
from worker.agent.job_tree import NotRegularFileError, open_at

log = logging.getLogger(__name__)

METRICS_FILE_NAME = "tensorboard.jsonl"
POLL_S = 1.0
MAX_EVENT_FILES = 200
# A record longer than this is skipped without being read. A scalar's event is well under
# 1 KiB (TensorFlow 1's merged summaries, scalars beside small images, a few hundred KiB);
# what is bigger holds images, audio or a model's graph, which are not read anyway. Parsing
# a record takes about ten times its size in memory: 4 MiB keeps a look under ~50 MB.
MAX_RECORD_BYTES = 4 << 20
# At most this much of one file is read per look (at least one whole record): a file
# written faster is caught up over the next looks.
MAX_BYTES_PER_POLL = 8 << 20
# Lines are appended to the metrics file in batches of at most this many.
_WRITE_BATCH = 4096
# Series named (a name of a folder's file for a rank) at most; past it new ones are not kept.
MAX_SERIES = 10_000
_HEADER = struct.Struct("<QI")  # the record's length, the masked CRC32C of the length
_FOOTER = 4  # the masked CRC32C of the data (not checked: a bad record fails to parse)
_SPACES = re.compile(r"\s")


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return tuple(table)


_CRC32C = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's check of a record's length: CRC32C (Castagnoli), rotated and offset."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _event_parser() -> tuple[Callable[[bytes], Any], type[Exception]]:
    """TensorBoard's ``Event`` parser and its error (ImportError without tensorboard)."""
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto.event_pb2 import Event

    return Event.FromString, DecodeError


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"


def mlflow_artifacts(outputs_dir: Path) -> Callable[[Path], bool]:
    """Whether a folder is one of the MLflow endpoint's artifact folders,
    ``<outputs>/mlflow/<run id>/artifacts`` (``worker.agent.mlflow_endpoint``)."""
    top = outputs_dir / "mlflow"
    return lambda folder: folder.name == "artifacts" and folder.parent.parent == top


def _sanitized(text: str) -> str:
    return _SPACES.sub("_", text)


class MetricNames:
    """The metric name of each series a placement's files hold, told apart by folder.

    A series is a base name (a tag, a CSV column) in the files of one folder (its owner)
    for one rank. The first owner of a name for a rank keeps it; another folder's series of
    that name is named ``<folder>/<name>``, then with the folder's parents
    (``<parent>/<folder>/<name>``...), the first that is a metric name no other folder holds
    for that rank; said once. A series that finds none is not kept (said once)."""

    def __init__(self, job_log: logging.Logger) -> None:
        self.job_log = job_log
        # (name, rank) → (the owner holding it, its folder as the job's log shows it)
        self._holder: dict[tuple[str, int], tuple[Hashable, str]] = {}
        self._chosen: dict[tuple[Hashable, int, str], str | None] = {}
        self._said_full = False

    def name(self, owner: Hashable, rank: int, base: str, folder: Sequence[str], what: str) -> str | None:
        """The metric name of ``base`` from the files of ``owner`` (whose folder's parts, the
        walked root's name first, are ``folder``); None when it is not kept."""
        key = (owner, rank, base)
        if key in self._chosen:
            return self._chosen[key]
        if len(self._chosen) >= MAX_SERIES:
            if not self._said_full:
                self._said_full = True
                self.job_log.warning(
                    "%s of %s is not kept: at most %d series are read from a job's files",
                    what,
                    "/".join(folder),
                    MAX_SERIES,
                )
            return None
        parts = [_sanitized(p) for p in folder]
        candidates = [base] + ["/".join([*parts[i:], base]) for i in range(len(parts) - 1, -1, -1)]
        shown = "/".join(folder)
        chosen = None
        for candidate in candidates:
            if not is_metric_name(candidate):
                continue
            holder = self._holder.get((candidate, rank))
            if holder is None or holder[0] == owner:
                chosen = candidate
                break
        self._chosen[key] = chosen
        first = self._holder.get((base, rank))
        if chosen is None:
            self.job_log.warning(
                "%s of %s is not kept: rank %d's metric %s comes from %s, and no name of its folder "
                "is free (a metric name is letters, digits and _ . : / -, at most 64)",
                what,
                shown,
                rank,
                base,
                first[1] if first else "another folder",
            )
            return None
        self._holder[(chosen, rank)] = (owner, shown)
        if chosen != base:
            self.job_log.warning(
                "%s of %s is the metric %s: rank %d's %s comes from %s",
                what,
                shown,
                chosen,
                rank,
                base,
                first[1] if first else "another folder",
            )
        return chosen


@dataclass
class _EventFile:
    """One event file, opened once, and how far it was read."""

    fh: BinaryIO
    name: str  # as the job's log names it
    rank: int
    owner: Hashable = None  # its folder (see MetricNames)
    folder: tuple[str, ...] = ()  # its folder's parts, the walked root's name first
    position: int = 0
    done: bool = False  # not read any more (corrupt, or the tailer stopped)
    skipped: bool = False  # a record over the cap was said

    def records(self, job_log: logging.Logger) -> Iterator[bytes]:
        """The whole records appended since the last look: at most MAX_BYTES_PER_POLL of
        them (at least one). Nothing is read that the file cannot hold, nor a record over
        MAX_RECORD_BYTES."""
        if self.done:
            return
        fd = self.fh.fileno()
        size = os.fstat(fd).st_size
        read = 0
        while not self.done and size - self.position >= _HEADER.size:
            header = os.pread(fd, _HEADER.size, self.position)
            if len(header) < _HEADER.size:
                return  # the file was cut short: wait
            length, check = _HEADER.unpack(header)
            if masked_crc32c(header[:8]) != check:
                self.done = True
                job_log.warning(
                    "TensorBoard event file %s is not read past byte %d: its record there is "
                    "corrupt (its length fails its check)",
                    self.name,
                    self.position,
                )
                return
            end = self.position + _HEADER.size + length + _FOOTER
            if length > MAX_RECORD_BYTES:
                if not self.skipped:
                    self.skipped = True
                    job_log.warning(
                        "TensorBoard event file %s: its record of %s at byte %d is skipped unread "
                        "(a record over %s holds images, audio or a graph, not scalars; "
                        "further ones of this file are skipped silently)",
                        self.name,
                        _size(length),
                        self.position,
                        _size(MAX_RECORD_BYTES),
                    )
                self.position = end
                continue
            if end > size or (read and read + end - self.position > MAX_BYTES_PER_POLL):
                return  # still being written, or enough for this look
            data = os.pread(fd, length, self.position + _HEADER.size)
            if len(data) < length:
                return
            read += end - self.position
            self.position = end
            yield data


def _scalar(value: Any) -> float | None:
    """The number of one summary value: a ``simple_value`` or a scalar tensor of the scalars plugin."""
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if value.HasField("tensor") and value.metadata.plugin_data.plugin_name == "scalars":
        from tensorboard.util import tensor_util

        array = tensor_util.make_ndarray(value.tensor)
        if array.size == 1:
            return float(array.reshape(()))
    return None


def _series_key(tag: str, folder: str) -> str | None:
    """The key of an ``add_scalars`` series: ``a`` for the tag ``L`` in the folder ``L_a``
    (``SummaryWriter`` names the folder ``<tag, / as _>_<key>``); None for another folder."""
    prefix = tag.replace("/", "_") + "_"
    if tag and folder.startswith(prefix) and len(folder) > len(prefix):
        return folder[len(prefix) :]
    return None


class ScalarTailer:
    """Reads the event files (and metrics CSV files) of one placement as they grow."""

    def __init__(
        self,
        roots: list[tuple[Path, int, bool]],
        metrics_dir: Path,
        job_log: logging.Logger,
        *,
        skip: Callable[[Path], bool] | None = None,
    ) -> None:
        # (folder, rank of what is found there, whether the folder is shared by the node)
        self.roots = roots
        # Folders not walked (the MLflow endpoint's artifact folders: mlflow_artifacts).
        self.skip = skip
        self.names = MetricNames(job_log)
        self.csv = csv_metrics.CsvMetrics(
            metrics_dir / csv_metrics.METRICS_FILE_NAME, job_log, self._csv_name
        )
        # The agent's own folder (out of the script's reach), made at the first write.
        self.out = metrics_dir / METRICS_FILE_NAME
        self.job_log = job_log
        # By (root's index, path under the root): every file opened, read or given up.
        self.files: dict[tuple[int, str], _EventFile] = {}
        # Names left out (not regular files), said once each; at most MAX_EVENT_FILES kept.
        self._left_out: set[tuple[int, str]] = set()
        self._said_too_many = False
        # (rank, file name) → the file as the job's log names it: an event file's name is
        # its writer's own (time, host, process), so one found again is a copy of it.
        self._by_name: dict[tuple[int, str], str] = {}
        self._skipped_tags: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.available = True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tensorboard-scalars", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling, read what the files hold now (every process has ended), close them."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        self.poll()
        with self._lock:
            for file in self.files.values():
                file.done = True
                file.fh.close()
            self.csv.close()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def _find(self) -> None:
        """Open the event files and metrics CSV files not seen before (links are not
        followed, nor opened)."""
        for index, (root, rank, _) in enumerate(self.roots):
            try:
                if not stat.S_ISDIR(os.lstat(root).st_mode):
                    continue
                for folder, dirs, names, dir_fd in os.fwalk(root, follow_symlinks=False):
                    dirs[:] = sorted(
                        d
                        for d in dirs
                        if not d.startswith(".")
                        and d != "__pycache__"
                        and not (self.skip is not None and self.skip(Path(folder) / d))
                    )
                    under = Path(folder).relative_to(root)
                    for name in sorted(names):
                        if "tfevents" in name and self.available:
                            self._open(index, (under / name).as_posix(), dir_fd, name, rank)
                        elif name in csv_metrics.CSV_NAMES:
                            parts = (root.name, *under.parts)
                            self.csv.found(
                                (index, (under / name).as_posix()),
                                dir_fd,
                                name,
                                f"{root.name}/{(under / name).as_posix()}",
                                rank,
                                ("csv", index, under.as_posix()),
                                parts,
                            )
            except OSError:
                continue  # the folder went away (or was made unreadable) between two looks

    def _csv_name(self, file: csv_metrics.CsvFile, column: str) -> str | None:
        return self.names.name(
            file.owner, file.rank, column, file.folder, f"the column {column!r} of {file.name}"
        )

    def _open(self, index: int, relative: str, dir_fd: int, name: str, rank: int) -> None:
        key = (index, relative)
        if key in self.files or key in self._left_out:
            return
        shown = f"{self.roots[index][0].name}/{relative}"
        original = self._by_name.get((rank, name))
        if original is not None:
            if len(self._left_out) < MAX_EVENT_FILES:
                self._left_out.add(key)
                self.job_log.warning(
                    "TensorBoard event file %s is not read: it is a copy of %s (an event file's name "
                    "is its writer's own)",
                    shown,
                    original,
                )
            return
        if len(self.files) >= MAX_EVENT_FILES:
            if not self._said_too_many:
                self._said_too_many = True
                self.job_log.warning(
                    "TensorBoard event file %s is not read: at most %d event files are",
                    shown,
                    MAX_EVENT_FILES,
                )
            return
        try:
            fh = open_at(dir_fd, name)  # a device is not even opened: open_at looks first
        except FileNotFoundError:
            return
        except NotRegularFileError:
            if len(self._left_out) < MAX_EVENT_FILES:
                self._left_out.add(key)
                self.job_log.warning(
                    "TensorBoard event file %s is not read: it is not a regular file "
                    "(a link, a FIFO or a device)",
                    shown,
                )
            return
        under = Path(relative).parent
        self._by_name[(rank, name)] = shown
        self.files[key] = _EventFile(
            fh, shown, rank, ("tfevents", index, under.as_posix()), (self.roots[index][0].name, *under.parts)
        )

    def poll(self) -> int:
        """Append the scalars (and CSV points) written since the last look; how many."""
        with self._lock:
            parser = None
            if self.available:
                try:
                    parser = _event_parser()
                except ImportError:
                    self.available = False
                    self.job_log.warning(
                        "TensorBoard event files are not read: this worker lacks the tensorboard package"
                    )
            count = 0
            try:
                self._find()
                if parser is not None:
                    for file in list(self.files.values()):
                        count += self._read(file, *parser)
                count += self.csv.poll()
            except Exception:  # a reading bug must not stop the job
                log.exception("reading TensorBoard event files and metrics CSV files failed")
            return count

    def _read(self, file: _EventFile, parse: Callable[[bytes], Any], corrupt: type[Exception]) -> int:
        """Append the scalars of the file's new records; how many."""
        lines: list[str] = []
        count = 0
        for data in file.records(self.job_log):
            try:
                event = parse(data)
            except corrupt:
                file.done = True
                self.job_log.warning(
                    "TensorBoard event file %s is not read past byte %d: its record there is corrupt",
                    file.name,
                    file.position - len(data) - _HEADER.size - _FOOTER,
                )
                break
            lines.extend(self._lines(event, file))
            if len(lines) >= _WRITE_BATCH:
                count += self._write(lines)
                lines = []
        return count + self._write(lines)

    def _write(self, lines: list[str]) -> int:
        if lines:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            with open(self.out, "a", encoding="utf-8") as fh:
                fh.write("".join(lines))
        return len(lines)

    def _lines(self, event: Any, file: _EventFile) -> Iterator[str]:
        if event.HasField("summary"):
            for value in event.summary.value:
                number = _scalar(value)
                if number is None or not math.isfinite(number):
                    continue  # the metrics API holds finite numbers
                tag, folder = value.tag, file.folder
                series = _series_key(tag, folder[-1] if len(folder) > 1 else "")
                if series is not None:
                    # add_scalars: the key's own folder names the series; its writer's
                    # folder tells it from another writer's.
                    tag, folder = f"{tag}/{series}", folder[:-1]
                base = _sanitized(tag)
                if not is_metric_name(base):
                    if tag not in self._skipped_tags and len(self._skipped_tags) < MAX_SERIES:
                        self._skipped_tags.add(tag)
                        self.job_log.warning(
                            "TensorBoard scalar %r is not kept: a metric name is letters, digits and "
                            "_ . : / - (at most 64)",
                            tag,
                        )
                    continue
                name = self.names.name(file.owner, file.rank, base, folder, f"TensorBoard scalar {tag!r}")
                if name is None:
                    continue
                point = {
                    "name": name,
                    "value": number,
                    "step": max(0, int(event.step)),
                    "rank": file.rank,
                    "time": float(event.wall_time),
                }
                yield json.dumps(point, separators=(",", ":")) + "\n"
