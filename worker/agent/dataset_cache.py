"""A node's cache of datasets, keyed by content checksum.

A dataset is downloaded once per node from the API (a worker route streaming a tar, or
with object storage a redirect to the archive it was uploaded as), extracted with the
same safe extractor the service uses, verified against its sha256,
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
from dataclasses import dataclass
from pathlib import Path

import httpx

from torchyard.apiclient import direct
from torchyard.contract.archive import ExtractionLimits, extract_archive
from torchyard.contract.dataset_digest import dataset_sha256, drop_ignored, find_data_root
from torchyard.contract.errors import InvalidDatasetError, error_from_body
from torchyard.contract.files import locked
from torchyard.contract.headers import CONTENT_BYTES_HEADER, FILES_HEADER, SHA256_HEADER

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


@dataclass(frozen=True)
class _Downloaded:
    size: int
    files: int | None
    content_bytes: int | None

    @property
    def stored(self) -> bool:
        """A stored archive (as uploaded), not the API's own tar: only its answer says how
        many bytes its content is."""
        return self.content_bytes is not None


def _header_int(headers: httpx.Headers, name: str) -> int | None:
    value = headers.get(name, "")
    return int(value) if value.isascii() and value.isdigit() else None


def _download(client: httpx.Client, what: str, sha256: str, dest: Path, url: str) -> _Downloaded:
    # Object storage answers with a redirect to the stored archive: followed (httpx keeps the
    # worker's token from the other host); the API's own headers describe the content.
    with client.stream("GET", url, follow_redirects=True) as response:
        if response.status_code != 200:
            response.read()
            try:
                body = response.json()
            except ValueError:
                body = response.text
            raise error_from_body(response.status_code, body)
        described = direct.api_headers(response)
        announced = described.get(SHA256_HEADER)
        if announced != sha256:
            raise InvalidDatasetError(
                f"{what}: the service sends content {announced!r}, the job expects {sha256!r}"
            )
        expected = response.headers.get("content-length")
        written = 0
        with open(dest, "wb") as out:
            for chunk in response.iter_bytes(_CHUNK):
                out.write(chunk)
                written += len(chunk)
        if expected is not None and written != int(expected):
            raise InvalidDatasetError(f"{what}: download incomplete ({written} of {expected} bytes)")
    return _Downloaded(
        size=written,
        files=_header_int(described, FILES_HEADER),
        content_bytes=_header_int(described, CONTENT_BYTES_HEADER),
    )


def _limits(got: _Downloaded) -> ExtractionLimits:
    """What the download may expand to: the API's own tar is not compressed (its content is no
    larger than itself, each file takes a 512-byte header); a stored archive, what the API
    says its content is, with room for its folders and the hidden entries it may hold."""
    if not got.stored:
        return ExtractionLimits(max_bytes=got.size, max_files=max(1, got.size // 512))
    defaults = ExtractionLimits()
    max_bytes = (got.content_bytes or 0) + (16 << 20)
    max_files = defaults.max_files if got.files is None else 2 * got.files + 1000
    return ExtractionLimits(max_bytes=max_bytes, max_files=max_files)


def fetch_dataset(
    client: httpx.Client,
    dataset_id: str,
    sha256: str,
    cache_dir: Path,
    *,
    url: str | None = None,
    what: str | None = None,
    unwrap: bool = True,
) -> Path:
    """The local data root (the folder of class folders) of a dataset, downloading it if needed.

    ``client`` is an httpx client with the API's base URL and the worker token. The
    content is checked against ``sha256`` (the checksum recorded at upload); a mismatch
    raises InvalidDatasetError naming the dataset, and nothing is cached. ``url`` fetches
    another content-addressed folder the same way (a script job's code package: ``what``
    names it, ``unwrap=False`` keeps its top folder as it is).

    The API answers with its own tar of the files, or (object storage) a redirect to the
    archive the dataset was uploaded as: a .tar, .tar.gz or .zip, perhaps around one
    wrapping folder, which the API never opened when the client uploaded it directly.
    Either is extracted safely; hidden entries are dropped (they are no part of a dataset),
    and the checksum of what is left must be the one recorded, so an archive holding any
    file its manifest did not list, or lacking one, is refused.
    """
    url = url or f"/v1/worker/datasets/{dataset_id}/archive"
    what = what or f"dataset {dataset_id}"
    if not _SHA256.match(sha256):
        raise InvalidDatasetError(f"{what}: {sha256!r} is not a sha256 checksum")
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
        archive = work / "dataset.archive"
        try:
            got = _download(client, what, sha256, archive, url)
            try:
                extracted = extract_archive(archive, work, _limits(got))
            except InvalidDatasetError as exc:
                raise InvalidDatasetError(f"{what}: {exc.message}", details=exc.details) from None
            archive.unlink()
            root = find_data_root(extracted) if unwrap and got.stored else extracted
            drop_ignored(root)
            got_sha = dataset_sha256(root)
            if got_sha != sha256:
                raise InvalidDatasetError(
                    f"{what}: downloaded content has checksum {got_sha}, expected {sha256} "
                    "(the archive does not hold the files its upload announced)"
                )
            final = cache_dir / sha256
            os.rename(root, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    log.info("%s (%s) cached in %s (%d bytes downloaded)", what, sha256, final, got.size)
    return final
