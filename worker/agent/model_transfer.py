"""Moving a model directory between a node and the API: upload after training, download to fine-tune.

With object storage (docs/storage.md) the archive goes straight to the store with presigned
URLs (:mod:`torchyard.apiclient.direct`; the API only plans and completes the upload), and
a download follows the API's redirect to a presigned URL: the archive's sha256 is the
``ETag`` of the API's own answer (the store's ETag is another thing).
"""

from __future__ import annotations

import logging
import tempfile
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from torchyard.apiclient import direct
from torchyard.contract.errors import InvalidModelDirectoryError, TorchyardError, error_from_body
from torchyard.contract.headers import LEASE_HEADER
from torchyard.contract.model_archive import (
    SHA256_HEADER,
    extract_model_archive,
    pack_model_dir,
    resolve_model_dir,
    sha256_of,
    verify_model_dir,
)
from worker.agent.api import Backoff
from worker.agent.retry import Deadline, due

log = logging.getLogger("worker.agent.reporting")

_RETRY_STATUS = frozenset({408, 425, 429})
_NO_SUCH_ROUTE = frozenset({404, 405, 501})
_TRANSFER_CHUNK = 1 << 20
_UPLOAD_TRIES = 5
# An archive unpacks to at most this many times its size (weights barely compress).
_UNPACK_RATIO = 4


# Whether each API client's artifacts go to an object store (GET /v1/storage), asked once.
_DIRECT: weakref.WeakKeyDictionary[httpx.Client, bool] = weakref.WeakKeyDictionary()


def is_direct(client: httpx.Client) -> bool:
    """Whether the API behind ``client`` takes artifacts by direct upload (asked once per
    client). An API that does not know ``GET /v1/storage`` (one older than object storage)
    takes them through its own routes."""
    found = _DIRECT.get(client)
    if found is None:
        try:
            found = direct.is_direct(client)
        except TorchyardError as exc:
            if exc.status_code not in _NO_SUCH_ROUTE:
                raise
            found = False
        _DIRECT[client] = found
    return found


def is_retryable(status: int) -> bool:
    return status >= 500 or status in _RETRY_STATUS


def response_body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _verify_model_dir(model_dir: Path) -> Path:
    """The folder holding the model files, checked against its manifest (no torch needed)."""
    folder = resolve_model_dir(model_dir)
    verify_model_dir(folder)
    return folder


def _file_chunks(fh: BinaryIO) -> Iterator[bytes]:
    while chunk := fh.read(_TRANSFER_CHUNK):
        yield chunk


def _outage(status: int) -> bool:
    """The API or its database is down or restarting (as opposed to a fault of its own)."""
    return status in (502, 503, 504)


def upload_model(
    client: httpx.Client,
    job_id: str,
    lease_token: str,
    model_dir: Path,
    *,
    outage_deadline: Deadline | None = None,
) -> str:
    """Verify, pack and upload a model directory (node rank 0); returns the archive's sha256.

    The archive is deterministic (sorted members, fixed times and owners, top-level
    ``model/``) and streamed from a temporary file beside the directory. Network errors
    and 5xx answers are retried; the API's refusals raise the matching ``TorchyardError``
    (409 ``StaleLeaseError``, 422 for a checksum or content problem...). An API that cannot
    be reached, or answers 502/503/504, is waited for until ``outage_deadline``
    (monotonic; default: a few tries); other failures get ``_UPLOAD_TRIES`` tries.
    """
    folder = _verify_model_dir(Path(model_dir))
    url = f"/v1/worker/jobs/{job_id}/model"
    with tempfile.TemporaryDirectory(prefix=".model-upload-", dir=folder.parent) as tmp:
        archive = Path(tmp) / "model.tar.gz"
        sha256, size = pack_model_dir(folder, archive)
        put_archive(
            client,
            url,
            archive,
            sha256,
            size,
            lease_token,
            f"job {job_id}: model",
            outage_deadline=outage_deadline,
            plan_url=f"{url}/upload",
        )
        return sha256


def put_archive(
    client: httpx.Client,
    url: str,
    archive: Path,
    sha256: str,
    size: int,
    lease_token: str,
    what: str,
    *,
    outage_deadline: Deadline | None = None,
    plan_url: str | None = None,
) -> None:
    """PUT an archive with its sha256 and the lease; network errors and 5xx are retried, the
    API's refusals raise the matching ``TorchyardError``. An API that cannot be reached, or
    answers 502/503/504, is waited for until ``outage_deadline`` (monotonic; default: a few
    tries); other failures get ``_UPLOAD_TRIES`` tries.

    With ``plan_url`` and an API whose artifacts are in an object store, the archive is
    uploaded there directly (the plan asked at ``plan_url``; parts already received are
    not sent again when a try is resumed); a plan of ``mode "api"`` falls back to the PUT."""
    headers = {
        LEASE_HEADER: lease_token,
        SHA256_HEADER: sha256,
        "Content-Length": str(size),
        "Content-Type": "application/gzip",
    }
    last_error: Exception | None = None
    backoff = Backoff(first=0.5)
    tries = 0
    while tries < _UPLOAD_TRIES:
        tries += 1
        in_outage = isinstance(last_error, httpx.TransportError) or (
            isinstance(last_error, TorchyardError) and _outage(last_error.status_code)
        )
        limit = due(outage_deadline)
        if in_outage and limit is not None and time.monotonic() < limit:
            tries = 1  # an outage: wait for the API rather than count tries
        try:
            response = None
            if plan_url is not None and is_direct(client):
                response = direct.upload(
                    client, plan_url, archive, headers={LEASE_HEADER: lease_token}, sha256=sha256
                )
            if response is None:
                with open(archive, "rb") as fh:
                    response = client.put(
                        url,
                        content=_file_chunks(fh),
                        headers=headers,
                        timeout=httpx.Timeout(60.0, read=900.0),
                    )
        except httpx.HTTPError as exc:
            last_error = exc
            log.warning("%s upload failed (%s), retrying", what, exc)
            time.sleep(backoff.next())
            continue
        except TorchyardError as exc:  # the API's answer to a direct upload's plan or completion
            if not is_retryable(exc.status_code):
                raise
            last_error = exc
            log.warning("%s upload failed (%s), retrying", what, exc)
            time.sleep(backoff.next())
            continue
        if response.status_code == 200:
            log.info("%s uploaded (%d bytes, sha256 %s)", what, size, sha256)
            return
        error = error_from_body(response.status_code, response_body(response))
        if not is_retryable(response.status_code):
            raise error
        last_error = error
        log.warning("%s upload got HTTP %d, retrying", what, response.status_code)
        time.sleep(backoff.next())
    raise TorchyardError(f"{what} upload failed after {_UPLOAD_TRIES} tries: {last_error}")


def download_model(client: httpx.Client, job_id: str, dest: Path) -> Path:
    """Fetch a succeeded job's model directory into ``dest`` (for ``init_from_job``).

    The archive is downloaded beside ``dest`` (resuming with ``Range`` after a broken
    connection; with object storage from the presigned URL the API redirects to), checked
    against the API's ``ETag`` (the sha256), unpacked safely and verified against its
    manifest. Returns ``dest``.
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
    """Bring ``archive`` to the whole archive; the ``ETag`` the API gave (its sha256).

    A resumed try sends only ``Range`` (no ``If-Range``: the object store's ETag is not
    ours): when the API now names another archive, what was written is dropped and the
    download starts over."""
    etag: str | None = None
    last_error: Exception | None = None
    backoff = Backoff(first=0.5)
    for _ in range(_UPLOAD_TRIES):
        written = archive.stat().st_size if archive.exists() else 0
        headers = {"Range": f"bytes={written}-"} if written and etag else {}
        try:
            with client.stream(
                "GET", url, headers=headers, timeout=httpx.Timeout(60.0), follow_redirects=True
            ) as response:
                named = direct.api_headers(response).get("etag", "").strip().strip('"') or None
                if response.status_code == 416 and written and named == etag:
                    return etag  # the previous try got every byte; only its ending broke
                if response.status_code not in (200, 206, 416):
                    response.read()
                    error = error_from_body(response.status_code, response_body(response))
                    if not is_retryable(response.status_code):
                        raise error
                    last_error = error
                    time.sleep(backoff.next())
                    continue
                if response.status_code == 416 or (response.status_code == 206 and named != etag):
                    archive.unlink(missing_ok=True)  # another archive than the one begun: start over
                    etag = named
                    continue
                etag = named
                mode = "ab" if response.status_code == 206 else "wb"
                with open(archive, mode) as out:
                    for chunk in response.iter_bytes(_TRANSFER_CHUNK):
                        out.write(chunk)
                return etag
        except httpx.HTTPError as exc:
            last_error = exc
            log.warning("job %s: model download interrupted (%s), resuming", job_id, exc)
            time.sleep(backoff.next())
    raise TorchyardError(f"model download of job {job_id} failed after {_UPLOAD_TRIES} tries: {last_error}")
