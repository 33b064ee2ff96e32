"""Datasets: packing and uploading image folders, registering, listing and finding them."""

from __future__ import annotations

import os
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import httpx

from torchyard.apiclient import direct
from torchyard.apiclient.models import Dataset, Page
from torchyard.apiclient.transport import ProgressCallback, Transport, segment
from torchyard.contract.archive import extract_archive
from torchyard.contract.dataset_digest import dataset_sha256, find_data_root, list_files
from torchyard.contract.deflate import GzipWriter, LevelChooser
from torchyard.contract.errors import TorchyardError
from torchyard.contract.manifests import DatasetManifest, dataset_files, dataset_manifest

AMBIGUOUS = "AmbiguousReferenceError"
"""The error code of a name or id prefix that matches several of the caller's objects."""


def pack_directory(folder: str | Path, dest: IO[bytes]) -> None:
    """Write ``folder`` as a .tar.gz into ``dest``: regular files and folders only.

    The archive holds one wrapping folder named like ``folder``; hidden entries are
    kept out, links and special files skipped (the service refuses them).
    """
    root = Path(folder)
    levels = LevelChooser()  # encoded images (JPEG, PNG) stored: they do not deflate further
    with (
        GzipWriter(dest) as gz,
        tarfile.open(fileobj=gz, mode="w") as tar,  # type: ignore[call-overload]
    ):

        def add(path: Path, arcname: str) -> None:
            info = tar.gettarinfo(str(path), arcname)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if info.isdir():
                info.mode = 0o755
                tar.addfile(info)
            elif info.isreg():
                info.mode = 0o644
                gz.set_level(levels.for_file(path, info.size))
                with open(path, "rb") as fh:
                    tar.addfile(info, fh)

        add(root, root.name)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            base = Path(dirpath)
            rel = base.relative_to(root)
            for name in dirnames:
                if not (base / name).is_symlink():
                    add(base / name, str(Path(root.name) / rel / name))
            for name in sorted(filenames):
                if not name.startswith(".") and not (base / name).is_symlink():
                    add(base / name, str(Path(root.name) / rel / name))


class ProgressReader:
    """A file wrapper reporting how much of it was read (for upload progress)."""

    def __init__(self, fh: IO[bytes], total: int, progress: ProgressCallback) -> None:
        self._fh = fh
        self._total = total
        self._done = 0
        self._progress = progress

    def read(self, size: int = -1) -> bytes:
        data = self._fh.read(size)
        self._done += len(data)
        self._progress(self._done, self._total)
        return data

    def __iter__(self) -> Iterator[bytes]:
        while chunk := self.read(1 << 16):
            yield chunk


# Pillow's names of the formats datasets may hold (what the service decodes them with).
_PILLOW_FORMATS = ("JPEG", "PNG", "BMP", "WEBP", "GIF", "TIFF")


def pillow_check() -> Callable[[Path], str | None] | None:
    """A decode of one image that says why it cannot be used (None: it can), where Pillow is
    installed (the worker and server extras); None where it is not."""
    try:
        from PIL import Image
    except ImportError:
        return None

    def check(path: Path) -> str | None:
        try:
            with Image.open(path, formats=_PILLOW_FORMATS) as im:
                im.load()
        except Image.UnidentifiedImageError:
            return "not a supported image"
        except Exception as exc:  # Pillow raises many types on bad data
            return f"cannot be decoded ({type(exc).__name__}: {exc})"
        return None

    return check


def describe_dataset(source: Path, archive: Path, scratch: Path) -> DatasetManifest:
    """The manifest of the dataset ``archive`` holds: of the folder ``source`` it was packed from,
    else of the archive itself, extracted into ``scratch`` as the nodes will extract it. Every
    image is decoded first where Pillow is installed (InvalidDatasetError naming the bad ones)."""
    check = pillow_check()
    if source.is_dir():
        return dataset_manifest(source, dataset_files(source), check_image=check)
    root = find_data_root(extract_archive(archive, scratch))
    return dataset_manifest(root, list_files(root), check_image=check)


def stores_directly(transport: Transport) -> bool:
    """Whether the API keeps artifacts in an object store that clients upload to directly
    (``GET /v1/storage``): asked once per upload."""
    try:
        return direct.is_direct(transport.http)
    except httpx.TransportError as exc:
        raise transport.unreachable(exc) from exc


def upload_direct(
    transport: Transport,
    plan_url: str,
    path: Path,
    *,
    fields: dict[str, Any],
    progress: ProgressCallback | None = None,
) -> Any:
    """A direct upload of ``path`` (object storage, docs/storage.md) and the API's answer to
    its completion, as JSON."""
    try:
        response = direct.upload(
            transport.http, plan_url, path, filename=path.name, fields=fields, progress=progress
        )
    except httpx.TransportError as exc:
        raise transport.unreachable(exc) from exc
    if response is None:  # pragma: no cover - the API said direct, then planned "api"
        raise TorchyardError(f"{plan_url} planned no direct upload though the API stores objects directly")
    return response.json()


class DatasetCalls:
    """The ``/v1/datasets`` routes."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def upload_dataset(
        self,
        path: str | Path,
        name: str | None = None,
        *,
        progress: ProgressCallback | None = None,
        timeout: float = 3600.0,
    ) -> Dataset:
        """Upload an ImageDirectory: a folder (packed to .tar.gz on the fly, in a temp file)
        or an archive file (.zip, .tar, .tar.gz/.tgz) as it is.

        With object storage (``GET /v1/storage``) the archive goes straight to the store: the
        API records the dataset from its manifest (the files' checksums and classes, computed
        here, every image decoded first where Pillow is installed), and each node checks the
        archive against it when it fetches it. Else the API receives and checks the archive."""
        source = Path(path)
        name = name or source.name.split(".")[0] or "dataset"
        with tempfile.TemporaryDirectory(prefix="torchyard-upload-") as tmp:
            if source.is_dir():
                archive = Path(tmp) / f"{source.name or 'dataset'}.tar.gz"
                with open(archive, "wb") as out:
                    pack_directory(source, out)
            elif source.is_file():
                archive = source
            else:
                raise FileNotFoundError(f"no such file or folder: {source}")
            if stores_directly(self._transport):
                manifest = describe_dataset(source, archive, Path(tmp) / "extracted")
                data = upload_direct(
                    self._transport,
                    "/v1/datasets/uploads",
                    archive,
                    fields={"name": name, "manifest": manifest.model_dump()},
                    progress=progress,
                )
                return Dataset.model_validate(data)
            total = archive.stat().st_size
            with open(archive, "rb") as fh:
                body: IO[bytes] | ProgressReader = (
                    ProgressReader(fh, total, progress) if progress is not None else fh
                )
                files = {"file": (archive.name, body, "application/octet-stream")}
                data = self._transport.json(
                    "POST",
                    "/v1/datasets",
                    data={"name": name},
                    files=files,
                    timeout=httpx.Timeout(self._transport.timeout, read=timeout, write=timeout),
                )
        return Dataset.model_validate(data)

    def upload_or_reuse_dataset(
        self, path: str | Path, name: str, *, progress: ProgressCallback | None = None
    ) -> tuple[Dataset, bool]:
        """The dataset ``name`` holding exactly the folder ``path`` (the same sha256) when
        there is one, else a new upload; and whether it was reused."""
        source = Path(path)
        if source.is_dir():
            digest = dataset_sha256(source)
            for dataset in self.iter_datasets():
                if dataset.name == name and dataset.sha256 == digest:
                    return dataset, True
        return self.upload_dataset(source, name, progress=progress), False

    def register_dataset(self, name: str, path: str, **options: Any) -> Dataset:
        """Register a folder on shared storage (under one of the service's dataset roots)."""
        body = {"name": name, "path": path, **options}
        return Dataset.model_validate(
            self._transport.json(
                "POST", "/v1/datasets", json=body, timeout=self._transport.read_timeout(3600.0)
            )
        )

    def list_datasets(self, *, limit: int | None = None, cursor: str | None = None) -> Page[Dataset]:
        params = {k: v for k, v in {"limit": limit, "cursor": cursor}.items() if v is not None}
        return Page[Dataset].model_validate(self._transport.json("GET", "/v1/datasets", params=params))

    def iter_datasets(self) -> Iterator[Dataset]:
        """Every dataset visible to the token, following the pages."""
        cursor: str | None = None
        while True:
            page = self.list_datasets(limit=200, cursor=cursor)
            yield from page.items
            if not page.next_cursor:
                return
            cursor = page.next_cursor

    def get_dataset(self, dataset_id: str) -> Dataset:
        return Dataset.model_validate(self._transport.json("GET", f"/v1/datasets/{segment(dataset_id)}"))

    def delete_dataset(self, dataset_id: str) -> None:
        """Delete a dataset (409 ``ConflictError`` while a live job uses it)."""
        self._transport.request("DELETE", f"/v1/datasets/{segment(dataset_id)}")

    def find_dataset(self, ref: str) -> Dataset:
        """A dataset by id, name or unique id prefix; of several with that exact name, the newest."""
        try:
            return self.get_dataset(ref)
        except TorchyardError as exc:
            if exc.status_code != 404 and exc.code != AMBIGUOUS:
                raise
            not_found = exc
        for dataset in self.iter_datasets():
            if dataset.name == ref:
                return dataset
        raise not_found
