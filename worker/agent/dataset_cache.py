"""A node's cache of datasets, keyed by content checksum.

A dataset is downloaded once per node from the API (a worker route streaming a tar),
extracted with the same safe extractor the service uses, verified against its sha256,
and moved into ``<cache>/<sha256>/`` with one rename. Two fetchers of the same dataset
on one node (two agents, or two jobs) serialise on a lock file: the second one finds
the first one's copy. A copy is never modified once in place.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from pathlib import Path

import httpx

from torchyard.contract.archive import ExtractionLimits, extract_archive
from torchyard.contract.dataset_digest import dataset_sha256
from torchyard.contract.errors import InvalidDatasetError, error_from_body
from torchyard.contract.files import locked
from torchyard.contract.headers import SHA256_HEADER

log = logging.getLogger(__name__)

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1024 * 1024
STAGING = ".staging"


def remove_interrupted_downloads(cache_dir: Path) -> int:
    """Remove what interrupted fetches (an agent killed mid-download) left in the staging
    folder; a fetch still in progress holds its dataset's lock and is left alone.
    Returns the number of folders removed."""
    staging = Path(cache_dir) / STAGING
    if not staging.is_dir():
        return 0
    removed = 0
    for entry in staging.iterdir():
        sha256 = entry.name.split("-", 1)[0]
        if not _SHA256.match(sha256):
            continue  # not written by a fetch
        try:
            with locked(Path(cache_dir) / f".{sha256}.lock", blocking=False):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed += 1
        except BlockingIOError:
            continue  # a fetch of this dataset is running
    if removed:
        log.info("removed %d interrupted dataset download(s) from %s", removed, staging)
    return removed


def cached_dataset(cache_dir: Path, sha256: str) -> Path | None:
    """The data root of a cached dataset, or None when it is not in the cache."""
    path = Path(cache_dir) / sha256
    return path if path.is_dir() else None


def _download(client: httpx.Client, dataset_id: str, sha256: str, dest: Path, url: str) -> int:
    with client.stream("GET", url) as response:
        if response.status_code != 200:
            response.read()
            try:
                body = response.json()
            except ValueError:
                body = response.text
            raise error_from_body(response.status_code, body)
        announced = response.headers.get(SHA256_HEADER)
        if announced != sha256:
            raise InvalidDatasetError(
                f"dataset {dataset_id}: the service sends content {announced!r}, the job expects {sha256!r}"
            )
        expected = response.headers.get("content-length")
        written = 0
        with open(dest, "wb") as out:
            for chunk in response.iter_bytes(_CHUNK):
                out.write(chunk)
                written += len(chunk)
        if expected is not None and written != int(expected):
            raise InvalidDatasetError(
                f"dataset {dataset_id}: download incomplete ({written} of {expected} bytes)"
            )
    return written


def fetch_dataset(
    client: httpx.Client, dataset_id: str, sha256: str, cache_dir: Path, *, url: str | None = None
) -> Path:
    """The local data root (the folder of class folders) of a dataset, downloading it if needed.

    ``client`` is an httpx client with the API's base URL and the worker token. The
    content is checked against ``sha256`` (the checksum recorded at upload); a mismatch
    raises InvalidDatasetError and nothing is cached. ``url`` fetches another content-addressed
    folder the same way (a script job's code package).
    """
    url = url or f"/v1/worker/datasets/{dataset_id}/archive"
    if not _SHA256.match(sha256):
        raise InvalidDatasetError(f"dataset {dataset_id}: {sha256!r} is not a sha256 checksum")
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    remove_interrupted_downloads(cache_dir)
    if (hit := cached_dataset(cache_dir, sha256)) is not None:
        return hit
    with locked(cache_dir / f".{sha256}.lock"):
        if (hit := cached_dataset(cache_dir, sha256)) is not None:
            return hit  # another fetcher finished while we waited
        # Everything this fetch writes lives in one folder named for the dataset, so a
        # clean-up can tell (by the dataset's lock) whether a fetcher still owns it.
        work = cache_dir / STAGING / f"{sha256}-{uuid.uuid4().hex}"
        work.mkdir(parents=True)
        tar_path = work / "dataset.tar"
        extracted: Path | None = None
        try:
            size = _download(client, dataset_id, sha256, tar_path, url)
            # The tar is not compressed: its content can be no larger than the tar itself,
            # and each file takes at least one 512-byte header.
            limits = ExtractionLimits(max_bytes=size, max_files=max(1, size // 512))
            extracted = extract_archive(tar_path, work, limits)
            got = dataset_sha256(extracted)
            if got != sha256:
                raise InvalidDatasetError(
                    f"dataset {dataset_id}: downloaded content has checksum {got}, expected {sha256}"
                )
            final = cache_dir / sha256
            os.rename(extracted, final)
            extracted = None
        finally:
            shutil.rmtree(work, ignore_errors=True)
    log.info("dataset %s (%s) cached in %s (%d bytes downloaded)", dataset_id, sha256, final, size)
    return final
