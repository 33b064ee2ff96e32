"""Safe extraction of uploaded dataset archives (.zip, .tar, .tar.gz/.tgz, .tar.bz2, .tar.xz).

An archive is extracted member by member into a fresh temporary folder inside a
staging folder; the caller then moves that folder into place with one rename. Every
member name is checked before anything is written: absolute paths, drive letters,
``..`` components, backslashes and control characters are refused, and so are
symbolic links, hard links, device files, fifos and sparse files: only regular files
and folders are ever created.

Bombs are refused before anything is written where the archive says how big it is: a
zip's central directory gives every member's size, and a tar header gives the size of
the member that follows it. Besides the absolute limit, content may be at most
``max_ratio`` times the archive's own size (above a small allowance), so a 2 MB archive
cannot fill gigabytes of staging space. Declared sizes may lie: the number of entries
and the bytes actually written are counted too, and writing stops the moment the running
total passes the limit. On any refusal or error the temporary folder is removed before
the error is raised.
"""

from __future__ import annotations

import bz2
import gzip
import io
import logging
import lzma
import os
import re
import shutil
import stat
import tarfile
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

from torchyard.contract.errors import InvalidDatasetError, TorchyardError

logger = logging.getLogger(__name__)

ArchiveFormat = Literal["zip", "tar", "tar.gz", "tar.bz2", "tar.xz"]

_CHUNK = 1024 * 1024
# Tar headers (pax records, GNU long names) are read by tarfile in one piece; a header
# that claims more than this is refused rather than loaded into memory.
_MAX_SINGLE_READ = 4 * _CHUNK
# Bytes a tar stream may hold beyond the file data: headers and padding for each entry.
_TAR_OVERHEAD_PER_ENTRY = 4096
_DRIVE = re.compile(r"^[A-Za-z]:")

# What a script job's outputs archive (``outputs.tar.gz``: a node's ``outputs/`` and
# ``logs/``) may hold once unpacked, in bytes of file content and in entries (files and
# folders). The API refuses an upload past either (413) and never unpacks more of a stored
# archive when it serves one of its files; the worker packs within them.
MAX_OUTPUTS_UNCOMPRESSED_BYTES = 8 * 1024**3
MAX_OUTPUTS_FILES = 100_000


@dataclass(frozen=True)
class ExtractionLimits:
    """Caps on what one archive may expand to.

    ``max_ratio`` (None: no such check) caps the content at that many times the size of
    the archive file; archives expanding to no more than ``ratio_allowance`` bytes pass
    whatever their ratio (small sets of very regular images compress very well).
    """

    max_bytes: int = 20 * 1024**3
    max_files: int = 500_000
    max_ratio: float | None = None
    ratio_allowance: int = 16 * 1024**2

    def byte_cap(self, archive_size: int) -> int:
        """The most bytes an archive of ``archive_size`` bytes may expand to."""
        if self.max_ratio is None:
            return self.max_bytes
        return min(self.max_bytes, max(self.ratio_allowance, int(archive_size * self.max_ratio)))


@dataclass(frozen=True)
class _ByteCap:
    """The byte limit of one extraction, and how to say why it is what it is."""

    limit: int
    archive_size: int
    limits: ExtractionLimits

    def too_large(self, message: str) -> str:
        """``message`` (which names the limit), with the reason for the limit when it is the ratio."""
        if self.limit < self.limits.max_bytes:
            message += (
                f"; content may be at most {self.limits.max_ratio:g} times the size of the archive "
                f"({self.archive_size} bytes): an archive expanding more is refused as a likely zip bomb "
                "(TORCHYARD_MAX_COMPRESSION_RATIO)"
            )
        return message


def detect_format(path: Path) -> ArchiveFormat:
    """The archive format of a file, from its content (the file name is not trusted)."""
    with open(path, "rb") as f:
        head = f.read(512)
    if head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return "zip"
    if head.startswith(b"\x1f\x8b"):
        return "tar.gz"
    if head.startswith(b"BZh"):
        return "tar.bz2"
    if head.startswith(b"\xfd7zXZ\x00"):
        return "tar.xz"
    if len(head) == 512 and head[257:262] == b"ustar":
        return "tar"
    if len(head) == 512:
        # Old (v7) tar archives have no magic; a valid header checksum identifies them.
        try:
            tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
            return "tar"
        except tarfile.HeaderError:
            pass
    raise InvalidDatasetError(
        "the uploaded file is not a .zip, .tar, .tar.gz/.tgz, .tar.bz2 or .tar.xz archive"
    )


def safe_member_parts(name: str) -> tuple[str, ...]:
    """The path components of an archive member name, or InvalidDatasetError if unsafe.

    Empty and ``.`` components are dropped (``./a//b`` is ``a/b``); the result is
    empty only for the archive's root folder itself.
    """
    if not name:
        raise InvalidDatasetError("archive member with an empty name")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        # tarfile keeps bytes that are not UTF-8 as lone surrogates: such a name could be
        # neither stored, listed nor shown.
        shown = name.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")
        raise InvalidDatasetError(
            f"archive member {shown!r} has a name that is not valid UTF-8; rename it and upload again"
        ) from None
    if "\\" in name:
        raise InvalidDatasetError(f"archive member {name!r} contains a backslash")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise InvalidDatasetError(f"archive member {name!r} contains control characters")
    if name.startswith("/"):
        raise InvalidDatasetError(f"archive member {name!r} has an absolute path")
    if _DRIVE.match(name):
        raise InvalidDatasetError(f"archive member {name!r} starts with a drive letter")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise InvalidDatasetError(f"archive member {name!r} contains a '..' component")
    return parts


class _Extractor:
    """Creates folders and files inside ``dest`` only, counting entries and bytes."""

    def __init__(self, dest: Path, limits: ExtractionLimits, cap: _ByteCap) -> None:
        self.dest = dest
        self.limits = limits
        self.cap = cap
        self.entries = 0
        self.bytes_written = 0

    def check_declared(self, name: str, size: int) -> None:
        """Refuse a member whose declared size would pass the limit, before writing it."""
        if self.bytes_written + size > self.cap.limit:
            raise InvalidDatasetError(
                self.cap.too_large(
                    f"the archive expands to more than {self.cap.limit} bytes "
                    f"(member {name!r} declares {size} bytes after {self.bytes_written} bytes before it)"
                )
            )

    def _count_entry(self, name: str) -> None:
        self.entries += 1
        if self.entries > self.limits.max_files:
            raise InvalidDatasetError(
                f"the archive holds more than {self.limits.max_files} entries (at member {name!r})"
            )

    def mkdir(self, name: str, parts: tuple[str, ...]) -> None:
        self._count_entry(name)
        if not parts:
            return
        try:
            self.dest.joinpath(*parts).mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as e:
            raise InvalidDatasetError(f"archive member {name!r} cannot be created: {e.strerror}") from e

    def write_file(self, name: str, parts: tuple[str, ...], src: IO[bytes]) -> None:
        self._count_entry(name)
        if not parts:
            raise InvalidDatasetError(f"archive member {name!r} is a file without a name")
        target = self.dest.joinpath(*parts)
        try:
            target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            # The tree holds no links (none are ever created), O_NOFOLLOW is defence in depth;
            # O_EXCL refuses a member that repeats an earlier one.
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError as e:
            raise InvalidDatasetError(f"archive member {name!r} appears more than once") from e
        except OSError as e:
            raise InvalidDatasetError(f"archive member {name!r} cannot be created: {e.strerror}") from e
        with os.fdopen(fd, "wb") as out:
            while True:
                chunk = src.read(_CHUNK)
                if not chunk:
                    break
                self.bytes_written += len(chunk)
                if self.bytes_written > self.cap.limit:
                    raise InvalidDatasetError(
                        self.cap.too_large(
                            f"the archive expands to more than {self.cap.limit} bytes "
                            f"(limit reached in member {name!r})"
                        )
                    )
                out.write(chunk)


class _ForwardReader:
    """A forward-only, size-capped view of a (decompressed) stream, for tarfile.

    tarfile only seeks forward when it walks an archive member by member; seeking is
    done by reading and discarding. The total read is capped so that a compressed
    stream of padding cannot keep the extraction busy forever.
    """

    def __init__(self, raw: io.BufferedIOBase, max_total: int, too_large: str) -> None:
        self.raw = raw
        self.pos = 0
        self.max_total = max_total
        self.too_large = too_large

    def _take(self, n: int) -> bytes:
        if self.pos + n > self.max_total:
            raise InvalidDatasetError(self.too_large)
        data = self.raw.read(n)
        self.pos += len(data)
        return data

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or size > _MAX_SINGLE_READ:
            raise InvalidDatasetError("the archive holds an oversized header record")
        return self._take(size)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence == os.SEEK_CUR:
            offset += self.pos
        elif whence != os.SEEK_SET:
            raise InvalidDatasetError("the archive stream cannot be read (seek from the end)")
        if offset < self.pos:
            raise InvalidDatasetError("the archive stream cannot be read (backward seek)")
        while self.pos < offset:
            if not self._take(min(_CHUNK, offset - self.pos)):
                break
        return self.pos

    def tell(self) -> int:
        return self.pos


def _open_decompressed(path: Path, fmt: ArchiveFormat) -> io.BufferedIOBase:
    if fmt == "tar.gz":
        return gzip.open(path, "rb")
    if fmt == "tar.bz2":
        return bz2.open(path, "rb")
    if fmt == "tar.xz":
        return lzma.open(path, "rb")
    return open(path, "rb")


def _extract_tar(path: Path, fmt: ArchiveFormat, ex: _Extractor) -> None:
    limits = ex.limits
    max_stream = ex.cap.limit + (limits.max_files + 16) * _TAR_OVERHEAD_PER_ENTRY
    with _open_decompressed(path, fmt) as raw:
        reader = _ForwardReader(
            raw,
            max_stream,
            ex.cap.too_large(f"the archive expands to more than {ex.cap.limit} bytes (with its headers)"),
        )
        with tarfile.open(fileobj=reader, mode="r:") as tf:  # type: ignore[call-overload]
            while (member := tf.next()) is not None:
                name = member.name
                parts = safe_member_parts(name)
                if member.issym() or member.islnk():
                    kind = "symbolic link" if member.issym() else "hard link"
                    raise InvalidDatasetError(
                        f"archive member {name!r} is a {kind} (to {member.linkname!r}); links are not allowed"
                    )
                if member.ischr() or member.isblk() or member.isfifo():
                    raise InvalidDatasetError(f"archive member {name!r} is a device or fifo; not allowed")
                if member.issparse():
                    raise InvalidDatasetError(f"archive member {name!r} is a sparse file; not allowed")
                if member.isdir():
                    ex.mkdir(name, parts)
                elif member.isreg():
                    ex.check_declared(name, member.size)
                    src = tf.extractfile(member)
                    if src is None:  # pragma: no cover - isreg() members always have data
                        raise InvalidDatasetError(f"archive member {name!r} has no data")
                    with src:
                        ex.write_file(name, parts, src)
                else:
                    raise InvalidDatasetError(f"archive member {name!r} has an unsupported type")
                # tarfile keeps every member it has seen; extraction only needs the current one.
                tf.members = []


def _precheck_zip(infos: list[zipfile.ZipInfo], cap: _ByteCap) -> None:
    """Refuse, before writing anything, what the central directory shows to be too big
    (sizes may lie: the bytes written are counted anyway)."""
    max_files = cap.limits.max_files
    if len(infos) > max_files:
        raise InvalidDatasetError(f"the archive holds {len(infos)} entries, more than {max_files}")
    declared = sum(i.file_size for i in infos)
    if declared > cap.limit:
        raise InvalidDatasetError(
            cap.too_large(f"the archive declares {declared} bytes of content, more than {cap.limit}")
        )


def _extract_zip(path: Path, ex: _Extractor) -> None:
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        _precheck_zip(infos, ex.cap)
        for info in infos:
            name = info.filename
            parts = safe_member_parts(name)
            mode = info.external_attr >> 16
            if stat.S_ISLNK(mode):
                raise InvalidDatasetError(
                    f"archive member {name!r} is a symbolic link; links are not allowed"
                )
            if mode and stat.S_IFMT(mode) not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise InvalidDatasetError(f"archive member {name!r} is a device, fifo or socket; not allowed")
            if info.flag_bits & 0x1:
                raise InvalidDatasetError(f"archive member {name!r} is encrypted")
            if info.is_dir() or stat.S_ISDIR(mode):
                ex.mkdir(name, parts)
                continue
            with zf.open(info) as src:
                ex.write_file(name, parts, src)


def extract_archive(archive: Path, staging_dir: Path, limits: ExtractionLimits | None = None) -> Path:
    """Extract ``archive`` into a new temporary folder inside ``staging_dir`` and return it.

    The caller owns the returned folder: it moves it into place (one rename on the same
    file system) or removes it. Raises InvalidDatasetError, with nothing left behind,
    if the archive is unreadable, unsafe, or expands beyond ``limits``.
    """
    limits = limits or ExtractionLimits()
    fmt = detect_format(archive)
    size = archive.stat().st_size
    staging_dir.mkdir(parents=True, exist_ok=True)
    dest = Path(tempfile.mkdtemp(prefix="extract-", dir=staging_dir))
    ex = _Extractor(dest, limits, _ByteCap(limits.byte_cap(size), size, limits))
    try:
        if fmt == "zip":
            _extract_zip(archive, ex)
        else:
            _extract_tar(archive, fmt, ex)
    except TorchyardError:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    except (
        zipfile.BadZipFile,
        zipfile.LargeZipFile,
        tarfile.TarError,
        EOFError,
        zlib.error,
        lzma.LZMAError,
        OSError,
        ValueError,
        NotImplementedError,
        RuntimeError,
    ) as e:
        shutil.rmtree(dest, ignore_errors=True)
        raise InvalidDatasetError(f"the {fmt} archive cannot be read: {e}") from e
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    logger.info("extracted %s archive: %d entries, %d bytes", fmt, ex.entries, ex.bytes_written)
    return dest
