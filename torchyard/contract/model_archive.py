"""The ``.tar.gz`` form of a model directory: packed deterministically, checked and unpacked safely.

An archive holds one top-level folder ``model/`` with the files its ``SHA256SUMS``
manifest lists (at least ``config.json``, ``model.safetensors`` and ``metrics.json``)
and the manifest itself; nothing else. Packing the same directory twice gives the same
bytes (sorted members, fixed times and owners, no gzip timestamp), so the archive's
sha256 identifies the model.

Checking and unpacking read the archive as a stream and refuse anything but regular
files directly under ``model/`` (no links, devices, nested folders or odd names), cap
the member count and the unpacked size (decompression bombs), and compare every file
with its manifest checksum. Used by the worker (upload, ``init_from_job`` download),
the API (upload check) and clients (download).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO

from torchyard.architectures import CLASSIFICATION_ARCHITECTURES
from torchyard.contract.dataset_digest import is_ignored_name
from torchyard.contract.deflate import GzipWriter, LevelChooser
from torchyard.contract.errors import InvalidModelDirectoryError
from torchyard.contract.files import sha256_file
from torchyard.contract.headers import SHA256_HEADER  # noqa: F401 - part of this module's interface

TOP_FOLDER = "model"
MANIFEST_FILE = "SHA256SUMS"
# The model directory layout (docs/models.md); torchyard.modeldir writes it.
REQUIRED_FILES = ("config.json", "model.safetensors", "metrics.json")
MAX_MEMBERS = 64
MAX_MANIFEST_BYTES = 64 * 1024
_CHUNK = 1 << 20
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class ArchivedFile:
    name: str
    size: int
    sha256: str


# The archive's checksum is the file's (kept under this name for the archive's readers).
sha256_of = sha256_file


def parse_manifest(text: str) -> dict[str, str]:
    """``SHA256SUMS`` lines (``<sha256>  <name>``) as ``{name: sha256}``; names are flat."""
    listed: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        name = name.strip()
        if not sep or not _SHA256.match(digest) or not _NAME.match(name) or name == MANIFEST_FILE:
            raise InvalidModelDirectoryError(f"{MANIFEST_FILE} line {number} is malformed")
        if name in listed:
            raise InvalidModelDirectoryError(f"{MANIFEST_FILE} lists {name} twice")
        listed[name] = digest
    missing = [name for name in REQUIRED_FILES if name not in listed]
    if missing:
        raise InvalidModelDirectoryError(f"{MANIFEST_FILE} does not list {', '.join(missing)}")
    return listed


def read_manifest(folder: str | Path) -> dict[str, str]:
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        raise InvalidModelDirectoryError(f"model directory has no {MANIFEST_FILE} manifest")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise InvalidModelDirectoryError(f"{MANIFEST_FILE} is too large")
    return parse_manifest(path.read_text(encoding="utf-8"))


def _member(name: str, size: int, *, directory: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if directory:
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
    else:
        info.mode = 0o644
    return info


def pack_model_dir(folder: str | Path, dest: str | Path) -> tuple[str, int]:
    """Write the deterministic ``.tar.gz`` of a model directory to ``dest``; ``(sha256, size)``.

    Only the manifest and the files it lists are packed, each checked against its
    checksum first, so the archive carries exactly what the manifest vouches for.
    """
    folder = Path(folder)
    listed = read_manifest(folder)
    for name, digest in listed.items():
        file = folder / name
        if not file.is_file() or file.is_symlink():
            raise InvalidModelDirectoryError(f"model directory is missing {name}")
        if sha256_of(file) != digest:
            raise InvalidModelDirectoryError(
                f"checksum mismatch for {name}: the file is corrupt or was modified"
            )
    names = sorted([*listed, MANIFEST_FILE])
    # Weights are stored, not deflated (they barely compress); the JSON files are deflated.
    levels = LevelChooser()
    with (
        open(dest, "wb") as raw,
        GzipWriter(raw) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.USTAR_FORMAT) as tar,  # type: ignore[call-overload]
    ):
        tar.addfile(_member(TOP_FOLDER, 0, directory=True))
        for name in names:
            path = folder / name
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                gz.set_level(levels.for_file(path, size))
                tar.addfile(_member(f"{TOP_FOLDER}/{name}", size), fh)
    return sha256_of(dest), Path(dest).stat().st_size


def _members(path: Path) -> Iterator[tuple[tarfile.TarFile, tarfile.TarInfo]]:
    with tarfile.open(path, "r|gz") as tar:
        for count, member in enumerate(tar, start=1):
            if count > MAX_MEMBERS:
                raise InvalidModelDirectoryError(f"model archive has more than {MAX_MEMBERS} entries")
            yield tar, member


def _file_name(member: tarfile.TarInfo) -> str | None:
    """The flat file name of an acceptable member; None for the ``model/`` folder entry."""
    name = member.name
    if member.type == tarfile.DIRTYPE and name.rstrip("/") == TOP_FOLDER:
        return None
    if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        raise InvalidModelDirectoryError(
            f"model archive entry {name!r} is not a regular file (links, devices and folders are refused)"
        )
    top, sep, base = name.partition("/")
    if top != TOP_FOLDER or not sep or not _NAME.match(base):
        raise InvalidModelDirectoryError(
            f"model archive entry {name!r} is not a plain file directly under {TOP_FOLDER}/"
        )
    return base


def _copy_member(source: IO[bytes], size: int, out: BinaryIO | None, manifest: bytearray | None) -> str:
    digest = hashlib.sha256()
    remaining = size
    while remaining:
        chunk = source.read(min(_CHUNK, remaining))
        if not chunk:
            raise InvalidModelDirectoryError("model archive is truncated")
        remaining -= len(chunk)
        digest.update(chunk)
        if out is not None:
            out.write(chunk)
        if manifest is not None:
            manifest.extend(chunk)
    return digest.hexdigest()


def _walk(path: Path, max_unpacked_bytes: int, extract_to: Path | None) -> dict[str, ArchivedFile]:
    try:
        return _walk_members(path, max_unpacked_bytes, extract_to)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise InvalidModelDirectoryError(f"model archive is not a valid .tar.gz: {exc}") from exc


def _walk_members(path: Path, max_unpacked_bytes: int, extract_to: Path | None) -> dict[str, ArchivedFile]:
    files: dict[str, ArchivedFile] = {}
    manifest_bytes: bytearray | None = None
    total = 0
    for tar, member in _members(path):
        name = _file_name(member)
        if name is None:
            continue
        if name in files:
            raise InvalidModelDirectoryError(f"model archive holds {name} twice")
        total += member.size
        if total > max_unpacked_bytes:
            raise InvalidModelDirectoryError(f"model archive unpacks to more than {max_unpacked_bytes} bytes")
        capture = None
        if name == MANIFEST_FILE:
            if member.size > MAX_MANIFEST_BYTES:
                raise InvalidModelDirectoryError(f"{MANIFEST_FILE} is too large")
            capture = manifest_bytes = bytearray()
        digest = _read_member(tar, member, name, extract_to, capture)
        files[name] = ArchivedFile(name=name, size=member.size, sha256=digest)
    _check_manifest(files, manifest_bytes)
    return files


def _read_member(
    tar: tarfile.TarFile,
    member: tarfile.TarInfo,
    name: str,
    extract_to: Path | None,
    capture: bytearray | None,
) -> str:
    """The member's sha256, its bytes written to ``extract_to``/``name`` if given and
    appended to ``capture`` if given."""
    source = tar.extractfile(member)
    if source is None:  # pragma: no cover - regular files always have a reader
        raise InvalidModelDirectoryError(f"cannot read {name} from the model archive")
    if extract_to is None:
        return _copy_member(source, member.size, None, capture)
    fd = os.open(extract_to / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "wb") as out:
        return _copy_member(source, member.size, out, capture)


def _check_manifest(files: dict[str, ArchivedFile], manifest_bytes: bytearray | None) -> None:
    """The archive's files are exactly those its manifest lists, with matching checksums."""
    if manifest_bytes is None:
        raise InvalidModelDirectoryError(f"model archive has no {TOP_FOLDER}/{MANIFEST_FILE} manifest")
    try:
        listed = parse_manifest(manifest_bytes.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidModelDirectoryError(f"{MANIFEST_FILE} is not UTF-8 text") from exc
    for name, digest in listed.items():
        if name not in files:
            raise InvalidModelDirectoryError(f"model archive is missing {name}")
        if files[name].sha256 != digest:
            raise InvalidModelDirectoryError(
                f"checksum mismatch for {name}: the file is corrupt or was modified"
            )
    unlisted = sorted(set(files) - set(listed) - {MANIFEST_FILE})
    if unlisted:
        raise InvalidModelDirectoryError(f"model archive holds files its manifest does not list: {unlisted}")


def inspect_model_archive(path: str | Path, *, max_unpacked_bytes: int) -> dict[str, ArchivedFile]:
    """Check a model archive without unpacking it; the files it holds by name.

    Raises ``InvalidModelDirectoryError`` for anything but a well-formed archive whose
    files all match the manifest.
    """
    return _walk(Path(path), max_unpacked_bytes, None)


def extract_model_archive(path: str | Path, dest: str | Path, *, max_unpacked_bytes: int) -> Path:
    """Unpack a model archive into the directory ``dest`` (replaced if present), checked.

    The files land in a temporary sibling folder first, which becomes ``dest`` only
    once every checksum matched.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.unpack-", dir=dest.parent))
    try:
        _walk(Path(path), max_unpacked_bytes, tmp)
        os.chmod(tmp, 0o755)
        if dest.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / dest.name)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
ONNX_FILE = "model.onnx"
MAX_CONFIG_BYTES = 1024 * 1024
# A model's input size: what training accepts (torchyard.contract.jobspec's image_size).
MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = 16, 1024


def _config_error(message: str) -> InvalidModelDirectoryError:
    return InvalidModelDirectoryError(f"{CONFIG_FILE}: {message}", details={"file": CONFIG_FILE})


def _check_classes(config: dict[str, Any]) -> None:
    classes = config.get("classes")
    if (
        not isinstance(classes, list)
        or not classes
        or not all(isinstance(c, str) and c for c in classes)
        or len(set(classes)) != len(classes)
    ):
        raise _config_error("classes must be a non-empty list of distinct class names")
    if config.get("num_classes") != len(classes):
        raise _config_error(f"num_classes must be {len(classes)}, the length of classes")


def _check_channel_stats(config: dict[str, Any]) -> None:
    for key in ("mean", "std"):
        values = config.get(key)
        if values is None:
            continue
        if (
            not isinstance(values, list)
            or len(values) != 3
            or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
            or (key == "std" and not all(v > 0 for v in values))
        ):
            raise _config_error(f"{key} must be a list of 3 numbers (one per RGB channel)")


def check_model_config(config: object, files: Iterable[str]) -> dict[str, Any]:
    """``config.json`` of a model directory, checked for what scoring, evaluation and the
    registry read from it; ``files`` are the directory's files (its manifest's names).

    Raises ``InvalidModelDirectoryError`` naming the field that is missing or wrong.
    """
    if not isinstance(config, dict):
        raise _config_error("not a JSON object")
    if config.get("format_version") != FORMAT_VERSION:
        raise _config_error(f"format_version must be {FORMAT_VERSION}, not {config.get('format_version')!r}")
    arch = config.get("architecture")
    if not isinstance(arch, str) or arch not in CLASSIFICATION_ARCHITECTURES:
        raise _config_error(f"architecture {arch!r} is not a torchvision classification architecture")
    _check_classes(config)
    size = config.get("image_size")
    if not isinstance(size, int) or isinstance(size, bool) or not MIN_IMAGE_SIZE <= size <= MAX_IMAGE_SIZE:
        raise _config_error(
            f"image_size must be a whole number of pixels from {MIN_IMAGE_SIZE} to {MAX_IMAGE_SIZE} "
            f"(as training's), not {size!r}"
        )
    _check_channel_stats(config)
    onnx = config.get("onnx")
    if onnx is not None and not isinstance(onnx, dict):
        raise _config_error("onnx must be an object")
    if ONNX_FILE in set(files) and (onnx or {}).get("file") != ONNX_FILE:
        raise _config_error(f'the directory holds {ONNX_FILE} but onnx.file is not "{ONNX_FILE}"')
    return config


# --------------------------------------------------------------------------- a model folder on disk


def _visible_dirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not is_ignored_name(p.name))


def resolve_model_dir(path: str | Path) -> Path:
    """The folder holding ``config.json``: ``path`` itself, or its one wrapping sub-folder.

    Extracting a downloaded ``.tar.gz`` may add a top-level folder; both layouts load.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise InvalidModelDirectoryError(f"model directory {folder.name!r} does not exist")
    if (folder / CONFIG_FILE).is_file():
        return folder
    subdirs = _visible_dirs(folder)
    if len(subdirs) == 1 and (subdirs[0] / CONFIG_FILE).is_file():
        return subdirs[0]
    raise InvalidModelDirectoryError(f"model directory {folder.name!r} has no {CONFIG_FILE}")


def verify_model_dir(path: str | Path) -> None:
    """Check the manifest: every required file is listed, present, and matches its sha256.

    Raises ``InvalidModelDirectoryError`` naming the first problem found.
    """
    folder = resolve_model_dir(path)
    manifest = folder / MANIFEST_FILE
    if not manifest.is_file():
        raise InvalidModelDirectoryError(f"model directory has no {MANIFEST_FILE} manifest")
    listed: dict[str, str] = {}
    for number, line in enumerate(manifest.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        name = name.strip()
        if (
            not sep
            or len(digest) != 64
            or not all(c in "0123456789abcdef" for c in digest)
            or not name
            or "/" in name
            or "\\" in name
            or name in (".", "..")
        ):
            raise InvalidModelDirectoryError(f"{MANIFEST_FILE} line {number} is malformed")
        listed[name] = digest
    for name in REQUIRED_FILES:
        if name not in listed:
            raise InvalidModelDirectoryError(f"{MANIFEST_FILE} does not list {name}")
    for name, digest in listed.items():
        file = folder / name
        if not file.is_file():
            raise InvalidModelDirectoryError(f"model directory is missing {name}")
        if sha256_of(file) != digest:
            raise InvalidModelDirectoryError(
                f"checksum mismatch for {name}: the file is corrupt or was modified"
            )
