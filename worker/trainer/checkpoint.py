"""``checkpoint.pt``: the full resumable state, written atomically at epoch ends (see
:class:`CheckpointSchedule`) and on a preemption.

Contents (plain tensors and Python scalars, so ``torch.load(weights_only=True)`` reads it):
``format_version``, ``job_id``, ``architecture``, ``classes``, ``world_size``,
``epoch`` (epochs completed), ``step`` (optimizer steps taken), ``model`` (state dict,
no ``module.`` prefix), ``optimizer``, ``scheduler``, ``early_stopping`` (best val
loss, best epoch, epochs without improvement), ``best_metric`` (lowest val loss),
``best_epoch``, ``best_model`` (weights of the best epoch, or None when that is
``model``), ``history`` (per-epoch metrics) and ``stopped`` (early stop reached).
Format 2 adds ``step_in_epoch`` (batches of epoch ``epoch + 1`` already trained: a
mid-epoch preemption checkpoint; 0 at an epoch end), ``sampler_epoch`` and
``rank_states`` (every rank's random generator states and loss sums, gathered to rank
0, indexed by global rank).

Beside it, ``checkpoint.json`` (written after the rename) describes the file the agent
uploads: ``epoch``, ``step_in_epoch``, ``step``, ``sha256`` and ``size_bytes`` (the
sha256 is computed over the bytes as they are written, so nobody reads the file again
to hash it), and ``inode`` and ``mtime_ns``, which tell the agent that the file it
opened is the one described.

Rank 0 writes in the background (:class:`CheckpointWriter`): training waits only for a
copy of the state (tensors cloned to CPU memory, see :func:`detached`), a thread
serialises it and publishes it while the next epoch trains.

The file is not fsynced. It is renamed into place only once whole, so a killed
process never leaves a torn ``checkpoint.pt``; what survives a crash of the node's
kernel (power lost) is the copy the agent uploaded, which the service fsyncs, and a
job whose node went down resumes from that copy, never from this file. Leaving the
writeback to the kernel costs training nothing: a checkpoint replaced an epoch later
is usually never written to the disk at all.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import torch

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_INFO_FILE = "checkpoint.json"
FORMAT_VERSION = 2
_READABLE_VERSIONS = (1, 2)


class _HashingWriter:
    """A binary file that hashes what is written to it."""

    def __init__(self, fh: IO[bytes]) -> None:
        self.fh = fh
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


@contextlib.contextmanager
def _without_crc32() -> Iterator[None]:
    # Only checkpoints are saved with torch.save in the trainer; the setting is process-wide.
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def save_checkpoint(
    path: str | Path, state: dict[str, Any], *, before_replace: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Write ``state`` to ``path`` through a temporary file and ``os.replace``, then its
    description (``checkpoint.json``); returns that description."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            writer = _HashingWriter(fh)
            # The sha256 covers every byte, so torch's per-record CRC32 is not computed.
            with _without_crc32():
                torch.save({"format_version": FORMAT_VERSION, **state}, writer)  # type: ignore[arg-type]
            fh.flush()
            written = os.fstat(fh.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    info = {
        "file": target.name,
        "epoch": int(state.get("epoch", 0)),
        "step_in_epoch": int(state.get("step_in_epoch", 0)),
        "step": int(state.get("step", 0)),
        "sha256": writer.digest.hexdigest(),
        "size_bytes": writer.size,
        # The renamed file keeps its inode and modification time: the agent checks them
        # on the file it opens instead of hashing it again.
        "inode": written.st_ino,
        "mtime_ns": written.st_mtime_ns,
    }
    info_path = target.with_name(CHECKPOINT_INFO_FILE)
    info_tmp = info_path.with_name(f".{info_path.name}.tmp")
    info_tmp.write_text(json.dumps(info), encoding="utf-8")
    os.replace(info_tmp, info_path)
    return info


def detached(value: Any) -> Any:
    """A copy of ``value`` that training cannot change any more: every tensor cloned to
    CPU memory, every dict, list and tuple rebuilt (scalars and strings are immutable)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: detached(item) for key, item in value.items()}
    if isinstance(value, list):
        return [detached(item) for item in value]
    if isinstance(value, tuple):
        return tuple(detached(item) for item in value)
    return value


INTERVAL_VAR = "TORCHYARD_CHECKPOINT_INTERVAL_S"
# Automatic interval: the time between two epoch-end checkpoints is at least this many
# times the last background write. The write then takes at most 1/80 (1.25 %) of the time;
# the agent's upload and the service's receipt took up to three times the write's CPU on the
# machines measured (bench/RESULTS.md), another 3.75 % at most: under 5 % in all.
AUTO_INTERVAL_FACTOR = 80.0


def checkpoint_interval() -> float | None:
    """``TORCHYARD_CHECKPOINT_INTERVAL_S``: the least seconds between two epoch-end
    checkpoints (0: every epoch), or None (unset: automatic, see :class:`CheckpointSchedule`)."""
    raw = os.environ.get(INTERVAL_VAR, "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{INTERVAL_VAR} must be a number of seconds, not {raw!r}") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"{INTERVAL_VAR} must be a finite number of seconds >= 0, not {raw!r}")
    return seconds


class CheckpointSchedule:
    """Rank 0's rule for which epoch ends get a checkpoint.

    Always: the first epoch end of an attempt (a restarted job always gains at least an
    epoch; it also measures what a checkpoint costs), the last epoch, an early stop and
    a preemption (the caller's part). In between, an epoch end gets one when at least
    ``interval`` seconds passed since the last checkpoint was handed to the writer:
    ``interval_s`` when set, else :data:`AUTO_INTERVAL_FACTOR` times the last background
    write. Cheap checkpoints (a small model) are so written after every epoch; one that
    costs much beside short epochs every few epochs, so that it stays a small part of
    the training time. A crash then redoes at most the epochs since the last checkpoint,
    with the same results (their random streams depend on the seed and epoch only).
    """

    def __init__(self, writer: CheckpointWriter | None, interval_s: float | None) -> None:
        self.writer = writer
        self.interval_s = interval_s
        self.last: float | None = None  # time.monotonic() of the last hand-over

    def interval(self) -> float:
        if self.interval_s is not None:
            return self.interval_s
        if self.writer is None or not self.writer.written:
            return 0.0
        return AUTO_INTERVAL_FACTOR * float(self.writer.written[-1]["write_seconds"])

    def due(self, now: float | None = None) -> bool:
        """Whether an ordinary epoch end gets a checkpoint now."""
        if self.writer is None:
            return False
        if self.last is None:
            return True
        if self.interval_s is None and self.writer.busy:
            return False  # the last write still runs: it costs more than an epoch
        now = time.monotonic() if now is None else now
        return now - self.last >= self.interval()

    def handed_over(self, now: float | None = None) -> None:
        self.last = time.monotonic() if now is None else now


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint in the background failed (raised on the training thread)."""


class CheckpointWriter:
    """Rank 0's checkpoint writer: :func:`save_checkpoint` in a background thread.

    :meth:`submit` waits for the previous write to finish (one write at a time, so
    checkpoints are published in order and at most one copy of the state is held),
    then starts writing the new one and returns. :meth:`wait` joins the write and
    raises :class:`CheckpointWriteError` if it failed; the preemption checkpoint, the
    end of training and every failure path join it, so the process never exits with a
    checkpoint half-written. A torn write never replaces ``checkpoint.pt`` (temporary
    file, then rename), so the previous checkpoint stays whole until the new one is.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.written: list[dict[str, Any]] = []  # the description of each checkpoint written
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._label = ""

    def submit(
        self, state: dict[str, Any], *, label: str, before_replace: Callable[[], None] | None = None
    ) -> float:
        """Write ``state`` in the background; the seconds the caller waited for the previous
        write. ``state`` is handed over: nothing in it may change afterwards (see :func:`detached`)."""
        started = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - started
        self._label = label
        self._thread = threading.Thread(
            target=self._write, args=(state, label, before_replace), name="checkpoint-writer"
        )
        self._thread.start()
        return waited

    def _write(self, state: dict[str, Any], label: str, before_replace: Callable[[], None] | None) -> None:
        started = time.perf_counter()
        cpu_started = time.thread_time()
        try:
            info = save_checkpoint(self.path, state, before_replace=before_replace)
        except BaseException as exc:  # reported on the training thread by wait()
            self._error = exc
            return
        seconds = time.perf_counter() - started
        cpu = time.thread_time() - cpu_started
        self.written.append({**info, "write_seconds": seconds, "write_cpu_seconds": cpu})
        log.info(
            "checkpoint after %s written in the background: %d bytes in %.2fs (%.2fs CPU)",
            label,
            info["size_bytes"],
            seconds,
            cpu,
        )

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Join the write in progress, if any; raise :class:`CheckpointWriteError` if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointWriteError(
                f"writing the checkpoint after {self._label} failed: {error}"
            ) from error

    def close(self) -> None:
        """Join the write in progress on a path that is already failing: log an error, never raise."""
        try:
            self.wait()
        except CheckpointWriteError as exc:
            log.error("%s", exc)


def load_checkpoint(
    path: str | Path, *, job_id: str, architecture: str, classes: list[str]
) -> dict[str, Any] | None:
    """The checkpoint at ``path`` if it exists and belongs to this job, else None.

    Loaded with ``weights_only=True``: nothing beyond tensors and plain containers is
    unpickled. A checkpoint of another job or model is ignored with a warning.
    """
    file = Path(path)
    if not file.is_file():
        return None
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # an unreadable checkpoint must not block the job
        log.warning("ignoring %s: cannot read it (%s); starting from scratch", file.name, exc)
        return None
    if not isinstance(state, dict) or state.get("format_version") not in _READABLE_VERSIONS:
        log.warning("ignoring %s: unknown checkpoint format", file.name)
        return None
    mismatches = [
        key
        for key, expected in (("job_id", job_id), ("architecture", architecture), ("classes", classes))
        if state.get(key) != expected
    ]
    if mismatches:
        log.warning("ignoring %s: it belongs to another job (%s differ)", file.name, ", ".join(mismatches))
        return None
    return state
