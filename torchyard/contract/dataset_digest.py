"""What a dataset's files are, and the content checksum that names a dataset.

The service and the worker must agree byte for byte on which files make up an
ImageDirectory dataset and on its checksum: the service computes it when a dataset is
created, the worker recomputes it after a download to verify what it received. Both
use this module.

The checksum of a dataset is the sha256 of a canonical manifest: one line
``<relpath>\\0<sha256 of the file, hex>\\n`` per file, sorted by ``relpath`` (the path
relative to the data root, ``/``-separated). File names cannot contain NUL, so the
manifest is unambiguous.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torchyard.contract.errors import InvalidDatasetError
from torchyard.contract.files import sha256_file

#: File name extensions of the supported image formats (lower case, with the dot).
IMAGE_EXTENSIONS: frozenset[str] = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff"}
)


def is_ignored_name(name: str) -> bool:
    """Hidden entries (``.DS_Store``, ``.git``...) and macOS ``__MACOSX`` folders are not data."""
    return name.startswith(".") or name == "__MACOSX"


def is_image_name(name: str) -> bool:
    """Whether a file name has one of the supported image extensions (case-insensitive)."""
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _visible_entries(folder: Path) -> list[os.DirEntry[str]]:
    with os.scandir(folder) as it:
        return sorted((e for e in it if not is_ignored_name(e.name)), key=lambda e: e.name)


def find_data_root(root: Path) -> Path:
    """The folder that holds the class folders: ``root``, or its single wrapping folder.

    ``root`` is unwrapped when it holds exactly one folder and nothing else, and that
    folder itself holds folders (a lone folder of images is a single class, not a wrapper).
    """
    entries = _visible_entries(root)
    if len(entries) == 1 and entries[0].is_dir():
        inner = Path(entries[0].path)
        if any(e.is_dir() for e in _visible_entries(inner)):
            return inner
    return root


def drop_ignored(root: Path) -> None:
    """Remove the ignored entries (see :func:`is_ignored_name`) below ``root``: they are not
    part of a dataset or a code package, so an extracted archive holds only what its
    checksum covers."""
    for folder, dirs, names in os.walk(root):
        for name in [*dirs, *names]:
            if is_ignored_name(name):
                path = Path(folder) / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
        dirs[:] = [d for d in dirs if not is_ignored_name(d)]


def _within(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def list_files(root: Path, *, link_roots: Sequence[Path] | None = None) -> list[str]:
    """Every data file below ``root`` as sorted ``/``-separated relative paths.

    Ignored names (see :func:`is_ignored_name`) are skipped, files and folders alike.
    Symbolic links are refused unless ``link_roots`` is given and the link resolves
    inside one of those (already resolved) roots; then it is followed. Anything that
    is neither a regular file nor a folder (sockets, devices, fifos) is refused.
    """
    roots = [Path(r) for r in link_roots] if link_roots is not None else None
    out: list[str] = []
    visited: set[tuple[int, int]] = set()

    def walk(folder: Path, prefix: str) -> None:
        st = folder.stat()
        key = (st.st_dev, st.st_ino)
        if key in visited:
            raise InvalidDatasetError(f"folder {prefix or '.'!r} is reached twice through links")
        visited.add(key)
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            if is_ignored_name(entry.name):
                continue
            rel = f"{prefix}{entry.name}"
            path = Path(entry.path)
            if entry.is_symlink():
                target = path.resolve()
                if roots is None or not _within(target, roots):
                    raise InvalidDatasetError(
                        f"{rel!r} is a symbolic link pointing outside the allowed roots"
                    )
                if not target.exists():
                    raise InvalidDatasetError(f"{rel!r} is a broken symbolic link")
            mode = path.stat().st_mode
            if stat.S_ISDIR(mode):
                walk(path, rel + "/")
            elif stat.S_ISREG(mode):
                out.append(rel)
            else:
                raise InvalidDatasetError(f"{rel!r} is not a regular file or folder")

    walk(Path(root), "")
    out.sort()
    return out


# A file's checksum in a dataset's manifest.
file_sha256 = sha256_file


def manifest_sha256(entries: Iterable[tuple[str, str]]) -> str:
    """The dataset checksum of ``(relpath, file sha256)`` pairs (sorted here)."""
    digest = hashlib.sha256()
    for rel, file_digest in sorted(entries):
        digest.update(rel.encode("utf-8", "surrogateescape"))
        digest.update(b"\0")
        digest.update(file_digest.encode("ascii"))
        digest.update(b"\n")
    return digest.hexdigest()


def hash_files(root: Path, files: Sequence[str], *, workers: int = 4) -> dict[str, str]:
    """sha256 of each of ``files`` (relative to ``root``), a few at a time."""
    root = Path(root)
    if workers <= 1 or len(files) < 2:
        return {rel: file_sha256(root / rel) for rel in files}
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(files, pool.map(lambda rel: file_sha256(root / rel), files), strict=True))


def dataset_sha256(root: Path, *, link_roots: Sequence[Path] | None = None, workers: int = 4) -> str:
    """The checksum of the dataset whose data root (the folder holding the class folders) is ``root``."""
    files = list_files(root, link_roots=link_roots)
    return manifest_sha256(hash_files(root, files, workers=workers).items())
