"""Training-state checkpoints between a node and the API (docs/restarts.md).

:class:`CheckpointUploader` runs beside the ranks of node rank 0: whenever the
trainer has written a new ``checkpoint.pt`` (announced by ``checkpoint.json``, which
carries its sha256, computed by the trainer as it wrote the bytes), it uploads it in a
thread of its own, so training never waits for the network. The file is not read
twice: when the opened file's inode, size and modification time are the ones
described, its sha256 is the described one (the API checks the bytes against it
anyway: a mismatch is refused with 422 and nothing is kept); otherwise (or for a
description without them) it is hashed first. When several checkpoints appear during
one upload, only the newest is sent next. :func:`download_checkpoint` fetches the checkpoint a claim names into the
run directory, checking its sha256.
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import httpx

from torchyard.apiclient import direct
from torchyard.contract.errors import StaleLeaseError, TorchyardError, error_from_body
from torchyard.contract.files import sha256_fileobj
from torchyard.contract.headers import (
    CHECKPOINT_EPOCH_HEADER,
    CHECKPOINT_STEP_HEADER,
    LEASE_HEADER,
    SHA256_HEADER,
)
from worker.agent import job_tree
from worker.agent.api import Backoff, is_retryable

log = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_INFO_FILE = "checkpoint.json"
_CHUNK = 1 << 20
_POLL_S = 0.5
_DOWNLOAD_TRIES = 4


def _url(job_id: str) -> str:
    return f"/v1/worker/jobs/{job_id}/checkpoint"


def _chunks(fh: BinaryIO) -> Iterator[bytes]:
    fh.seek(0)
    while chunk := fh.read(_CHUNK):
        yield chunk


@dataclass(frozen=True)
class Uploaded:
    sha256: str
    epoch: int
    step: int | None
    size: int
    seconds: float
    cpu_seconds: float = 0.0  # of the uploading thread


class CheckpointUploader:
    """Uploads each new checkpoint of a run directory in a background thread."""

    def __init__(
        self,
        client: httpx.Client,
        job_id: str,
        lease_token: str,
        run_dir: Path,
        logger: logging.Logger | None = None,
    ) -> None:
        self.client = client
        self.job_id = job_id
        self.lease_token = lease_token
        self.run_dir = Path(run_dir)
        self.log = logger or log
        self.uploaded: list[Uploaded] = []
        self.lease_lost = False
        # Descriptions whose file does not hash to their sha256: never sent (a newer one is awaited).
        self._bad: set[str] = set()
        # Whether checkpoints go to an object store (docs/storage.md): asked once.
        self._direct: bool | None = None
        self._stopping = threading.Event()
        self._idle = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"checkpoints-{job_id[:8]}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def last_sha256(self) -> str | None:
        return self.uploaded[-1].sha256 if self.uploaded else None

    def _pending(self) -> dict[str, object] | None:
        """The newest checkpoint's description when it is not uploaded yet."""
        try:
            with job_tree.open_regular(self.run_dir, CHECKPOINT_INFO_FILE) as info_file:
                info = json.loads(info_file.read(1 << 20).decode("utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(info, dict) or info.get("sha256") in (self.last_sha256, *self._bad):
            return None
        return info

    def _run(self) -> None:
        backoff = Backoff(first=0.5, cap=10.0)
        while not self.lease_lost:
            info = self._pending()
            if info is None:
                self._idle.set()
                if self._stopping.is_set():
                    return
                self._stopping.wait(_POLL_S)
                continue
            self._idle.clear()
            try:
                self._upload(info)
                backoff.reset()
            except StaleLeaseError as exc:
                self.log.warning("checkpoint upload refused, the lease is gone: %s", exc.message)
                self.lease_lost = True
            except Exception as exc:
                if self._stopping.is_set():
                    self.log.warning("checkpoint upload failed while stopping: %s", exc)
                    return
                delay = backoff.next()
                self.log.warning("checkpoint upload failed (%s); retrying in %.1f s", exc, delay)
                self._stopping.wait(delay)
        self._idle.set()

    def _upload(self, info: dict[str, object]) -> None:
        started = time.monotonic()
        cpu_started = time.thread_time()
        with job_tree.open_regular(self.run_dir, CHECKPOINT_FILE) as fh:
            # The open file is the bytes we send, even if the trainer replaces the path meanwhile.
            stat = os.fstat(fh.fileno())
            size = stat.st_size
            described = _describes(info, stat)
            sha256 = str(info.get("sha256")) if described else sha256_fileobj(fh, rewind=True)
            if sha256 != info.get("sha256"):
                return  # replaced between the description and the open: the next poll takes the newer
            epoch = int(str(info.get("epoch", 0)))
            step_in_epoch = int(str(info.get("step_in_epoch", 0)))
            headers = {LEASE_HEADER: self.lease_token, CHECKPOINT_EPOCH_HEADER: str(epoch)}
            if step_in_epoch:
                headers[CHECKPOINT_STEP_HEADER] = str(step_in_epoch)
            if self._direct is None:
                self._direct = direct.is_direct(self.client)
            try:
                response = self._upload_direct(fh, headers, sha256) if self._direct else None
            except _Changed as exc:
                self._bad.add(sha256)
                self.log.warning("checkpoint.pt is not what checkpoint.json describes (%s); skipping it", exc)
                return
            if response is None:
                response = self.client.put(
                    _url(self.job_id),
                    content=_chunks(fh),
                    headers={
                        **headers,
                        SHA256_HEADER: sha256,
                        "Content-Length": str(size),
                        "Content-Type": "application/octet-stream",
                    },
                    timeout=httpx.Timeout(300.0, connect=10.0),
                )
            if response.status_code == 422 and described and sha256_fileobj(fh, rewind=True) != sha256:
                # The file is not what its description says (changed in place, or a reused
                # inode): never send it again; the trainer's next checkpoint is awaited.
                self._bad.add(sha256)
                self.log.warning("checkpoint.pt does not match the sha256 of checkpoint.json; skipping it")
                return
        if response.status_code >= 400:
            raise error_from_body(response.status_code, _body(response))
        done = Uploaded(
            sha256,
            epoch,
            step_in_epoch or None,
            size,
            time.monotonic() - started,
            time.thread_time() - cpu_started,
        )
        self.uploaded.append(done)
        self.log.info(
            "checkpoint of epoch %d%s uploaded: %d bytes in %.2f s",
            epoch,
            f" step {step_in_epoch}" if step_in_epoch else "",
            size,
            done.seconds,
        )

    def _upload_direct(self, fh: BinaryIO, headers: dict[str, str], sha256: str) -> httpx.Response | None:
        """Upload the open file straight to the object store (docs/storage.md)."""
        try:
            # The open file (not the path, which the trainer may replace meanwhile).
            return direct.upload(
                self.client,
                f"{_url(self.job_id)}/upload",
                Path(f"/proc/self/fd/{fh.fileno()}"),
                headers=headers,
                sha256=sha256,
            )
        except OSError as exc:
            raise _Changed(str(exc)) from exc

    def flush(self, timeout: float) -> bool:
        """Wait until the newest checkpoint is uploaded (or ``timeout``); True if it is."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.lease_lost:
            if self._pending() is None and self._idle.is_set():
                return True
            time.sleep(0.1)
        return self._pending() is None

    def stop(self, timeout: float = 0.0) -> None:
        """Upload what is pending within ``timeout`` seconds, then stop the thread."""
        if timeout > 0:
            self.flush(timeout)
        self._stopping.set()
        self._thread.join(timeout=max(1.0, timeout))


def _describes(info: dict[str, object], stat: os.stat_result) -> bool:
    """Whether ``info`` (``checkpoint.json``) describes the open file of ``stat``: same
    inode, size and modification time (a description without them describes nothing)."""
    expected = (info.get("inode"), info.get("size_bytes"), info.get("mtime_ns"))
    return all(isinstance(v, int) for v in expected) and expected == (
        stat.st_ino,
        stat.st_size,
        stat.st_mtime_ns,
    )


def _body(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return response.text


def download_checkpoint(
    client: httpx.Client, job_id: str, lease_token: str, run_dir: Path
) -> dict[str, object]:
    """Fetch the job's latest good checkpoint into ``run_dir/checkpoint.pt``; what it is.

    The bytes must match the ``X-Torchyard-Sha256`` the API sends (a transfer cut short
    or altered on the way is fetched again, then refused). 404 (none) raises ``NotFoundError``.
    """
    last: Exception | None = None
    for attempt in range(_DOWNLOAD_TRIES):
        if attempt:
            time.sleep(min(10.0, 0.5 * 2**attempt))
        try:
            return _download_once(client, job_id, lease_token, Path(run_dir))
        except TorchyardError as exc:
            if not is_retryable(exc):
                raise
            last = exc
        except (httpx.TransportError, ChecksumMismatch) as exc:
            last = exc
        log.warning("checkpoint download failed (%s); trying again", last)
    assert last is not None
    raise last


class ChecksumMismatch(Exception):
    pass


class _Changed(Exception):
    """The checkpoint file changed while it was read for a direct upload."""


def _download_once(client: httpx.Client, job_id: str, lease_token: str, run_dir: Path) -> dict[str, object]:
    target = run_dir / CHECKPOINT_FILE
    with client.stream(
        "GET",
        _url(job_id),
        headers={LEASE_HEADER: lease_token},
        timeout=httpx.Timeout(300.0, connect=10.0),
        follow_redirects=True,  # object storage: to a presigned URL of the store
    ) as response:
        if response.status_code >= 400:
            response.read()
            raise error_from_body(response.status_code, _body(response))
        described = direct.api_headers(response)
        expected = described.get(SHA256_HEADER, "")
        epoch = described.get(CHECKPOINT_EPOCH_HEADER)
        step = described.get(CHECKPOINT_STEP_HEADER)
        fd, tmp = tempfile.mkstemp(prefix=".checkpoint-download-", dir=run_dir)
        try:
            digest = hashlib.sha256()
            size = 0
            with os.fdopen(fd, "wb") as fh:
                for chunk in response.iter_bytes(_CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
                    fh.write(chunk)
                fh.flush()
                os.fsync(fh.fileno())
            if digest.hexdigest() != expected:
                raise ChecksumMismatch(
                    f"the checkpoint's bytes hash to {digest.hexdigest()}, the API announced {expected}"
                )
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return {
        "sha256": expected,
        "epoch": int(epoch) if epoch and epoch.isdecimal() else None,
        "step": int(step) if step and step.isdecimal() else None,
        "size_bytes": size,
    }
