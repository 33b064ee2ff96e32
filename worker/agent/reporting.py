"""Shipping a run's metrics, logs and model directory to the API.

:class:`RunReporter` tails, in a background thread, what a placement's ranks write:

* ``<run dir>/events.jsonl`` (metric points, progress, the result; complete lines only);
* each rank's log files (``log_sources()`` is asked every cycle, since torchrun creates
  them late; several files may feed one stream, e.g. a rank's stdout and stderr);
* the agent's own launcher log (stream ``agent-<node name>``);

and posts them in batches to ``POST /v1/worker/jobs/{id}/reports`` about every half
second, at once when a batch is full. One batch is in flight at a time and is retried,
unchanged, with backoff until the API takes it: file positions only move when a batch
is built, so while the API is down nothing more is read (memory stays bounded by one
batch), and a retried batch is recognised by the API (metric points by their key, log
chunks by stream and byte offset) so nothing is stored twice. A 409 ``StaleLeaseError``
ends the reporter and sets :attr:`RunReporter.lease_lost`.

Log offsets count the UTF-8 bytes of what was shipped. Invalid UTF-8 and NUL bytes
become U+FFFD; a multi-byte character split by a read waits for its remaining bytes.

:func:`upload_model` packs and uploads the model directory (node rank 0);
:func:`download_model` fetches a succeeded job's model directory for fine-tuning.
"""

from __future__ import annotations

import json
import logging
import math
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from torchyard.errors import InvalidModelDirectoryError, StaleLeaseError, TorchyardError, error_from_body
from torchyard.model_archive import (
    SHA256_HEADER,
    extract_model_archive,
    pack_model_dir,
    sha256_of,
)
from worker.trainer.events import EVENTS_FILE, METRIC_NAMES

log = logging.getLogger(__name__)

LEASE_HEADER = "X-Torchyard-Lease"
# What one batch may carry; the API accepts more, this keeps requests quick.
MAX_BATCH_METRICS = 2000
MAX_BATCH_LOG_BYTES = 1 << 20
MAX_BATCH_LOG_CHUNKS = 500
# One read of one log file. After U+FFFD replacement a chunk stays below the API's 256 KiB.
LOG_READ_BYTES = 64 * 1024
EVENTS_READ_BYTES = 256 * 1024
_RETRY_STATUS = frozenset({408, 425, 429})
_TRANSFER_CHUNK = 1 << 20
_UPLOAD_TRIES = 5
# An archive unpacks to at most this many times its size (weights barely compress).
_UNPACK_RATIO = 4


def _is_retryable(status: int) -> bool:
    return status >= 500 or status in _RETRY_STATUS


def _body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


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
class _LogFile:
    stream: str
    path: Path
    position: int = 0


@dataclass
class _Batch:
    metrics: list[dict[str, Any]] = field(default_factory=list)
    logs: list[dict[str, Any]] = field(default_factory=list)
    progress: dict[str, Any] | None = None
    result: dict[str, Any] | None = None
    log_bytes: int = 0
    full: bool = False

    def empty(self) -> bool:
        return not (self.metrics or self.logs or self.progress or self.result)

    def payload(self) -> dict[str, Any]:
        return {"metrics": self.metrics, "logs": self.logs, "progress": self.progress, "result": self.result}


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


def _metric_point(event: dict[str, Any]) -> dict[str, Any] | None:
    name, value = event.get("name"), _finite(event.get("value"))
    epoch, step, rank = _int(event.get("epoch")), _int(event.get("step")), _int(event.get("rank", 0))
    if name not in METRIC_NAMES or value is None or epoch is None or step is None or rank is None:
        return None
    return {
        "name": name,
        "value": value,
        "epoch": epoch,
        "step": step,
        "rank": rank,
        "time": _iso_time(event.get("time")),
    }


def _progress(event: dict[str, Any]) -> dict[str, Any] | None:
    values = {
        "epoch": _int(event.get("epoch")),
        "epochs": _int(event.get("epochs"), 1),
        "step": _int(event.get("step")),
        "total_steps": _int(event.get("total_steps")),
    }
    if any(v is None for v in values.values()):
        return None
    return {**values, "time": _iso_time(event.get("time"))}


def _metric_dict(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        return {}
    out = {}
    for name, number in value.items():
        number = _finite(number)
        if name in METRIC_NAMES and number is not None:
            out[name] = number
    return out


def _result(event: dict[str, Any]) -> dict[str, Any] | None:
    best_epoch, epochs_run = _int(event.get("best_epoch")), _int(event.get("epochs_run"))
    if best_epoch is None or epochs_run is None:
        return None
    return {
        "best_epoch": best_epoch,
        "best": _metric_dict(event.get("best")),
        "final": _metric_dict(event.get("final")) if event.get("final") is not None else None,
        "stopped_early": bool(event.get("stopped_early", False)),
        "epochs_run": epochs_run,
    }


class RunReporter:
    """Ships one placement's metrics and logs to the API from a background thread.

    ``start()`` begins tailing; ``stop()`` reads everything written so far, ships it and
    ends (call it before reporting the placement's final status: the lease ends there).
    """

    def __init__(
        self,
        client: httpx.Client,
        job_id: str,
        lease_token: str,
        run_dir: Path,
        log_sources: Callable[[], list[tuple[str, Path]]],
        agent_log: Path,
        node_name: str,
        *,
        interval: float = 0.5,
        max_backoff: float = 10.0,
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.lease_token = lease_token
        self.events_path = Path(run_dir) / EVENTS_FILE
        self.log_sources = log_sources
        self.agent_stream = f"agent-{node_name}"
        self.agent_log = Path(agent_log)
        self.interval = interval
        self.max_backoff = max_backoff
        self.url = f"/v1/worker/jobs/{job_id}/reports"

        self._files: dict[Path, _LogFile] = {}
        self._stream_offsets: dict[str, int] = {}
        self._rotation = 0
        self._events_position = 0
        self._skipping_long_line = False
        self._stopping = threading.Event()
        self._deadline = math.inf
        self._thread: threading.Thread | None = None
        self._lease_lost = False
        self._drained = False
        self.stats = {"batches": 0, "metrics": 0, "log_bytes": 0, "retries": 0, "dropped_batches": 0}

    @property
    def lease_lost(self) -> bool:
        """True once the API answered 409 ``StaleLeaseError``: the reporter has stopped."""
        return self._lease_lost

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("reporter already started")
        self._thread = threading.Thread(target=self._run, name=f"reporter-{self.job_id[:8]}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> bool:
        """Ship everything written so far, then end. True when it all reached the API
        (False when the lease was lost or the API stayed unreachable for ``timeout`` s)."""
        self._deadline = time.monotonic() + timeout
        self._stopping.set()
        if self._thread is None:
            self._run()  # never started: drain in the caller's thread
        else:
            self._thread.join(timeout + 5.0)
            if self._thread.is_alive():
                log.warning("job %s: the reporter did not finish within %.0f s", self.job_id, timeout)
                return False
        return self._drained and not self._lease_lost

    # --- the loop ------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = self.interval
        batch: _Batch | None = None
        while True:
            final = self._stopping.is_set()
            if batch is None:
                try:
                    batch = self._collect(final)
                except Exception:  # a reporting bug must not take the agent down
                    log.exception("job %s: reading run files failed", self.job_id)
                    batch = _Batch()
                if batch.empty():
                    batch = None
                    if final:
                        self._drained = True
                        return
                    self._stopping.wait(self.interval)
                    continue
            if self._send(batch):
                full = batch.full
                batch = None
                backoff = self.interval
                if self._lease_lost:
                    return
                if not final and not full:
                    self._stopping.wait(self.interval)
                continue
            self.stats["retries"] += 1
            delay = min(backoff, self.max_backoff) * random.uniform(0.75, 1.25)
            backoff = min(backoff * 2, self.max_backoff)
            if final:
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    log.warning(
                        "job %s: giving up on %d metric points and %d log bytes: the API stayed unreachable",
                        self.job_id,
                        len(batch.metrics),
                        batch.log_bytes,
                    )
                    return
                time.sleep(min(delay, remaining))
            else:
                self._stopping.wait(delay)

    def _send(self, batch: _Batch) -> bool:
        """Post a batch. True when done with it (stored, refused for good, or lease lost);
        False to retry it later."""
        try:
            response = self.client.post(
                self.url, json=batch.payload(), headers={LEASE_HEADER: self.lease_token}, timeout=30.0
            )
        except httpx.HTTPError as exc:
            log.warning("job %s: report failed (%s), will retry", self.job_id, exc)
            return False
        if response.status_code == 200:
            self.stats["batches"] += 1
            self.stats["metrics"] += len(batch.metrics)
            self.stats["log_bytes"] += batch.log_bytes
            return True
        body = _body(response)
        code = body.get("code") if isinstance(body, dict) else None
        if response.status_code == 409 and code == StaleLeaseError.code:
            log.warning("job %s: lease lost, reporting stops: %s", self.job_id, body.get("message"))
            self._lease_lost = True
            return True
        if _is_retryable(response.status_code):
            log.warning("job %s: report got HTTP %d, will retry", self.job_id, response.status_code)
            return False
        # Retrying a request the API refuses would block every later batch.
        self.stats["dropped_batches"] += 1
        log.error(
            "job %s: the API refused a report batch (HTTP %d): %s", self.job_id, response.status_code, body
        )
        return True

    # --- reading -------------------------------------------------------------------------

    def _collect(self, final: bool) -> _Batch:
        batch = _Batch()
        self._read_events(batch)
        self._refresh_sources()
        self._read_logs(batch, final)
        return batch

    def _refresh_sources(self) -> None:
        try:
            sources = [*self.log_sources(), (self.agent_stream, self.agent_log)]
        except Exception:
            log.exception("job %s: listing log files failed", self.job_id)
            sources = [(self.agent_stream, self.agent_log)]
        for stream, path in sources:
            path = Path(path)
            if path not in self._files:
                self._files[path] = _LogFile(stream, path)
                self._stream_offsets.setdefault(stream, 0)

    def _read_events(self, batch: _Batch) -> None:
        try:
            with open(self.events_path, "rb") as fh:
                fh.seek(self._events_position)
                data = fh.read(EVENTS_READ_BYTES)
        except FileNotFoundError:
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
        self._events_position += consumed

    def _take_event(self, batch: _Batch, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            log.warning("job %s: ignoring a malformed line in %s", self.job_id, EVENTS_FILE)
            return
        if not isinstance(event, dict):
            return
        kind = event.get("type")
        parsed: dict[str, Any] | None = None
        if kind == "metric":
            parsed = _metric_point(event)
            if parsed is not None:
                batch.metrics.append(parsed)
        elif kind == "progress":
            parsed = _progress(event)
            if parsed is not None:
                batch.progress = parsed
        elif kind == "result":
            parsed = _result(event)
            if parsed is not None:
                batch.result = parsed
        else:
            return
        if parsed is None:
            log.warning("job %s: ignoring an invalid %s event", self.job_id, kind)

    def _read_logs(self, batch: _Batch, final: bool) -> None:
        files = list(self._files.values())
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

    def _read_log(self, batch: _Batch, source: _LogFile, limit: int, final: bool) -> bool:
        try:
            with open(source.path, "rb") as fh:
                size = fh.seek(0, 2)
                if size < source.position:
                    # Truncated under us: carry on from its new start, the stream keeps growing.
                    source.position = 0
                fh.seek(source.position)
                raw = fh.read(limit)
        except (FileNotFoundError, IsADirectoryError, PermissionError):
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


# --- the model directory ---------------------------------------------------------------------


def _verify_model_dir(model_dir: Path) -> Path:
    """The folder holding the model files, checked against its manifest when the loader is
    installed (it imports torch); packing checks every checksum in any case."""
    try:
        from torchyard.modeldir import resolve_model_dir, verify_model_dir
    except ImportError:  # pragma: no cover - the worker installs torch
        return model_dir
    folder = resolve_model_dir(model_dir)
    verify_model_dir(folder)
    return folder


def _file_chunks(fh: BinaryIO) -> Iterator[bytes]:
    while chunk := fh.read(_TRANSFER_CHUNK):
        yield chunk


def _backoff(attempt: int) -> None:
    time.sleep(min(10.0, 0.5 * 2**attempt) * random.uniform(0.75, 1.25))


def upload_model(client: httpx.Client, job_id: str, lease_token: str, model_dir: Path) -> str:
    """Verify, pack and upload a model directory (node rank 0); returns the archive's sha256.

    The archive is deterministic (sorted members, fixed times and owners, top-level
    ``model/``) and streamed from a temporary file beside the directory. Network errors
    and 5xx answers are retried; the API's refusals raise the matching ``TorchyardError``
    (409 ``StaleLeaseError``, 422 for a checksum or content problem...).
    """
    folder = _verify_model_dir(Path(model_dir))
    url = f"/v1/worker/jobs/{job_id}/model"
    with tempfile.TemporaryDirectory(prefix=".model-upload-", dir=folder.parent) as tmp:
        archive = Path(tmp) / "model.tar.gz"
        sha256, size = pack_model_dir(folder, archive)
        headers = {
            LEASE_HEADER: lease_token,
            SHA256_HEADER: sha256,
            "Content-Length": str(size),
            "Content-Type": "application/gzip",
        }
        last_error: Exception | None = None
        for attempt in range(_UPLOAD_TRIES):
            try:
                with open(archive, "rb") as fh:
                    response = client.put(
                        url,
                        content=_file_chunks(fh),
                        headers=headers,
                        timeout=httpx.Timeout(60.0, read=900.0),
                    )
            except httpx.HTTPError as exc:
                last_error = exc
                log.warning("job %s: model upload failed (%s), retrying", job_id, exc)
                _backoff(attempt)
                continue
            if response.status_code == 200:
                log.info("job %s: model uploaded (%d bytes, sha256 %s)", job_id, size, sha256)
                return sha256
            error = error_from_body(response.status_code, _body(response))
            if not _is_retryable(response.status_code):
                raise error
            last_error = error
            log.warning("job %s: model upload got HTTP %d, retrying", job_id, response.status_code)
            _backoff(attempt)
    raise TorchyardError(f"model upload of job {job_id} failed after {_UPLOAD_TRIES} tries: {last_error}")


def download_model(client: httpx.Client, job_id: str, dest: Path) -> Path:
    """Fetch a succeeded job's model directory into ``dest`` (for ``init_from_job``).

    The archive is downloaded beside ``dest`` (resuming with ``Range`` after a broken
    connection), checked against its ``ETag`` (the sha256), unpacked safely and verified
    against its manifest. Returns ``dest``.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    url = f"/v1/worker/jobs/{job_id}/model"
    with tempfile.TemporaryDirectory(prefix=f".{dest.name}.download-", dir=dest.parent) as tmp:
        archive = Path(tmp) / "model.tar.gz"
        etag = _fetch(client, url, archive, job_id)
        digest = sha256_of(archive)
        if etag and digest != etag:
            raise InvalidModelDirectoryError(
                f"the model of job {job_id} arrived corrupted (sha256 {digest}, expected {etag})"
            )
        limit = max(archive.stat().st_size * _UNPACK_RATIO, 1 << 20)
        extract_model_archive(archive, dest, max_unpacked_bytes=limit)
    _verify_model_dir(dest)
    return dest


def _fetch(client: httpx.Client, url: str, archive: Path, job_id: str) -> str | None:
    etag: str | None = None
    last_error: Exception | None = None
    for attempt in range(_UPLOAD_TRIES):
        written = archive.stat().st_size if archive.exists() else 0
        headers = {"Range": f"bytes={written}-", "If-Range": f'"{etag}"'} if written and etag else {}
        try:
            with client.stream("GET", url, headers=headers, timeout=httpx.Timeout(60.0)) as response:
                if response.status_code == 416 and written:
                    return etag  # the previous try got every byte; only its ending broke
                if response.status_code not in (200, 206):
                    response.read()
                    error = error_from_body(response.status_code, _body(response))
                    if not _is_retryable(response.status_code):
                        raise error
                    last_error = error
                    _backoff(attempt)
                    continue
                etag = response.headers.get("etag", "").strip().strip('"') or None
                mode = "ab" if response.status_code == 206 else "wb"
                with open(archive, mode) as out:
                    for chunk in response.iter_bytes(_TRANSFER_CHUNK):
                        out.write(chunk)
                return etag
        except httpx.HTTPError as exc:
            last_error = exc
            log.warning("job %s: model download interrupted (%s), resuming", job_id, exc)
            _backoff(attempt)
    raise TorchyardError(f"model download of job {job_id} failed after {_UPLOAD_TRIES} tries: {last_error}")
