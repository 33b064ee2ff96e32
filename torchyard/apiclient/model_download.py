"""Downloading a job's model: a resumable, checksummed archive unpacked and verified.

With object storage (docs/storage.md) the API answers with a redirect to a presigned URL
of the archive, followed here (the token is not sent to the store): the archive's sha256
is the ``ETag`` of the API's own answer, and a resume's ``Range`` goes to the store."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

import httpx

from torchyard.apiclient import direct
from torchyard.apiclient.models import Job
from torchyard.apiclient.transport import ProgressCallback, Transport, raise_for, segment
from torchyard.contract.errors import InvalidModelDirectoryError
from torchyard.contract.model_archive import extract_model_archive

MAX_MODEL_UNPACKED_BYTES = 64 * 1024**3


def etag_digest(value: str | None) -> str | None:
    if not value:
        return None
    value = value.strip()
    value = value.removeprefix("W/")
    return value.strip('"') or None


def _range_headers(have: int) -> dict[str, str]:
    """A resume's ``Range``. No ``If-Range``: the redirect to an object store would carry it to
    the store, whose ETag is not the sha256; the API's ``ETag`` is checked here instead."""
    return {"Range": f"bytes={have}-"} if have else {}


def _hash_file(path: Path, hasher: hashlib._Hash) -> None:
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            hasher.update(block)


def _resumed_at(response: httpx.Response, have: int) -> int:
    """The bytes of the part file the response continues: ``have`` on a resume, else 0."""
    if not (response.status_code == 206 and have > 0):
        return 0
    start = int(response.headers.get("content-range", "bytes 0-").split()[1].split("-")[0])
    if start != have:
        raise InvalidModelDirectoryError(f"the service resumed at byte {start}, not {have}")
    return have


def _append_body(
    response: httpx.Response,
    out: IO[bytes],
    hasher: hashlib._Hash,
    have: int,
    progress: ProgressCallback | None,
) -> None:
    length = response.headers.get("content-length")
    total = have + int(length) if length is not None else None
    done = have
    for chunk in response.iter_bytes(1 << 20):
        out.write(chunk)
        hasher.update(chunk)
        done += len(chunk)
        if progress is not None:
            progress(done, total)
    out.flush()
    os.fsync(out.fileno())


class ModelDownloads:
    """``GET /v1/jobs/{id}/model`` into a verified model directory."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def _model_sha256(self, job_id: str) -> str | None:
        """The sha256 of the job's model archive (None until it has one)."""
        job = Job.model_validate(self._transport.json("GET", f"/v1/jobs/{segment(job_id)}"))
        return job.model_sha256

    def download_model(
        self,
        job_id: str,
        dest: str | Path,
        *,
        progress: ProgressCallback | None = None,
        keep_archive: bool = False,
        on_resume: Callable[[int], None] | None = None,
    ) -> Path:
        """Download a succeeded job's model directory into ``dest`` and verify it.

        The archive is written to ``<dest>.tar.gz.part``; an interrupted download is
        resumed from there with an HTTP Range request (if the model is still the same
        one, by its ETag). The complete archive must match its sha256 (the ETag), is
        unpacked safely, and its manifest is verified before ``dest`` appears. A redirect
        to an object store (docs/storage.md) is followed.
        """
        target = Path(dest)
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise FileExistsError(f"{target} already exists and is not empty")
        archive = target.with_name(target.name + ".tar.gz")
        part = archive.with_name(archive.name + ".part")
        target.parent.mkdir(parents=True, exist_ok=True)
        expected = self._model_sha256(job_id)
        digest = self.fetch_archive(job_id, part, expected, progress=progress, on_resume=on_resume)
        if expected and digest != expected:
            part.unlink(missing_ok=True)
            raise InvalidModelDirectoryError(
                f"downloaded model sha256 {digest} does not match the job's {expected}; try again"
            )
        os.replace(part, archive)
        try:
            # Only plain files under model/; the manifest must list the required files and
            # every file must match its checksum, in a temporary sibling that becomes
            # ``target`` once all of it checked out. (No torch import: this stays fast.)
            extract_model_archive(archive, target, max_unpacked_bytes=MAX_MODEL_UNPACKED_BYTES)
        finally:
            if not keep_archive:
                archive.unlink(missing_ok=True)
        return target

    def fetch_archive(
        self,
        job_id: str,
        part: Path,
        expected: str | None,
        *,
        progress: ProgressCallback | None,
        on_resume: Callable[[int], None] | None,
    ) -> str:
        """Bring ``part`` to the whole archive (resuming it when possible); return its sha256."""
        hasher = hashlib.sha256()
        have = part.stat().st_size if part.exists() else 0
        path = f"/v1/jobs/{segment(job_id)}/model"
        try:
            with self._transport.http.stream(
                "GET",
                path,
                headers=_range_headers(have),
                timeout=self._transport.read_timeout(300.0),
                follow_redirects=True,  # object storage: to a presigned URL of the store
            ) as response:
                if response.status_code == 416 and have:
                    # The part file is not a prefix of this model (or already too long): restart.
                    response.read()
                    part.unlink()
                    return self.fetch_archive(job_id, part, expected, progress=progress, on_resume=on_resume)
                raise_for(response)
                etag = etag_digest(direct.api_headers(response).get("etag"))
                if expected and etag and etag != expected:
                    raise InvalidModelDirectoryError(f"the service sent model {etag}, expected {expected}")
                have = _resumed_at(response, have)
                if have:
                    _hash_file(part, hasher)
                    if on_resume is not None:
                        on_resume(have)
                with open(part, "ab" if have else "wb") as out:
                    _append_body(response, out, hasher, have, progress)
        except httpx.TransportError as exc:
            raise self._transport.unreachable(exc) from exc
        digest = hasher.hexdigest()
        if etag and digest != etag:
            part.unlink(missing_ok=True)
            raise InvalidModelDirectoryError(
                f"downloaded model sha256 {digest} does not match its ETag {etag}"
            )
        return digest
