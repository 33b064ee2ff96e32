"""Manifests of folders uploaded straight to the object store (docs/storage.md).

With object storage a client PUTs a dataset's or a code package's archive to the store
itself, and the API never sees its bytes: it records the folder from the *manifest* the
client computed (every file's path and sha256, the content checksum of
:mod:`torchyard.contract.dataset_digest`, the classes of a dataset) after checking the
manifest's own rules. What the manifest cannot prove (that the archive holds these
files, that the images decode) is checked by the readers: a node extracts the archive
and recomputes the checksum before it uses a byte of it, and the CLI decodes every image
before it uploads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from pydantic import Field

from torchyard.contract.base import StrictModel
from torchyard.contract.dataset_digest import (
    hash_files,
    is_ignored_name,
    list_files,
    manifest_sha256,
)
from torchyard.contract.errors import InvalidDatasetError, NotLabeledDatasetError

_SHA256 = r"^[0-9a-f]{64}$"


class FolderManifest(StrictModel):
    """The files of a folder (a code package, or a dataset's data root)."""

    sha256: str = Field(
        pattern=_SHA256, description="The content checksum of the files (as datasets and packages have it)."
    )
    num_files: int = Field(ge=0, description="How many files.")
    size_bytes: int = Field(ge=0, description="The files' sizes added up.")
    files: dict[str, str] = Field(
        description="Each file's sha256 by its path relative to the folder ('/'-separated)."
    )


class DatasetManifest(FolderManifest):
    """The files of an ImageDirectory dataset's data root (the folder of class folders)."""

    classes: list[str] = Field(description="The class folders, sorted.")
    class_counts: dict[str, int] = Field(description="Images per class.")


def _sizes(root: Path, files: list[str]) -> int:
    return sum((root / rel).stat().st_size for rel in files)


def folder_manifest(root: Path, files: list[str] | None = None, *, workers: int = 4) -> FolderManifest:
    """The manifest of ``files`` below ``root`` (every file :func:`list_files` finds when None)."""
    root = Path(root)
    listed = sorted(files) if files is not None else list_files(root)
    digests = hash_files(root, listed, workers=workers)
    return FolderManifest(
        sha256=manifest_sha256(digests.items()),
        num_files=len(listed),
        size_bytes=_sizes(root, listed),
        files=digests,
    )


def dataset_files(folder: Path) -> list[str]:
    """The files a packed dataset folder holds (what ``pack_directory`` writes): regular files
    only, symbolic links skipped, ignored names left out; sorted relative paths."""
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(folder):
        base = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not is_ignored_name(d) and not (base / d).is_symlink())
        rel = base.relative_to(folder)
        for name in filenames:
            path = base / name
            if is_ignored_name(name) or path.is_symlink() or not path.is_file():
                continue
            out.append((rel / name).as_posix())
    return sorted(out)


def dataset_manifest(
    data_root: Path,
    files: list[str] | None = None,
    *,
    check_image: Callable[[Path], str | None] | None = None,
    workers: int = 4,
) -> DatasetManifest:
    """The manifest of a dataset whose class folders are in ``data_root``.

    ``check_image(path)`` (the CLI's Pillow decode, where Pillow is installed) says why an
    image cannot be used; any refusal raises InvalidDatasetError naming the files. The
    layout rules themselves are the API's to check (it refuses a bad manifest)."""
    root = Path(data_root)
    listed = sorted(files) if files is not None else list_files(root)
    if not any("/" in rel for rel in listed):
        raise NotLabeledDatasetError(
            f"{root} has no class folders; put each image in a sub-folder named after its class"
        )
    if check_image is not None:
        bad = [(rel, why) for rel in listed if (why := check_image(root / rel))]
        if bad:
            shown = "; ".join(f"{rel!r}: {why}" for rel, why in bad[:5])
            raise InvalidDatasetError(
                f"{len(bad)} image(s) cannot be used: {shown}", details={"files": [r for r, _ in bad[:100]]}
            )
    base = folder_manifest(root, listed, workers=workers)
    counts: dict[str, int] = {}
    for rel in listed:
        if "/" in rel:
            cls = rel.split("/", 1)[0]
            counts[cls] = counts.get(cls, 0) + 1
    return DatasetManifest(**base.model_dump(), classes=sorted(counts), class_counts=counts)
