"""Reading one file of a stored outputs archive (.tar.gz) without reading the whole archive
each time (``GET /v1/jobs/{id}/outputs?path=``).

A gzip stream can only be decompressed from its start. The first file asked of an archive
reads it once to its end and keeps an :class:`ArchiveIndex`: where each regular file's
bytes lie in the uncompressed tar stream, and, every :data:`SPACING` bytes of that
stream, a copy of the decompressor's state with the compressed offset it had reached
(an access point). A file is then read from the last access point before it: at most
:data:`SPACING` bytes are decompressed to reach it, whatever its place in the archive.

The walk stops as soon as the archive holds more than
:data:`~torchyard.contract.archive.MAX_OUTPUTS_FILES` entries or
:data:`~torchyard.contract.archive.MAX_OUTPUTS_UNCOMPRESSED_BYTES` bytes of files (an
upload past them is refused, so only an archive stored before these limits can): such an
archive's files are not served one by one. Indexes are kept in memory per API process,
the least recently used dropped first, keyed by the archive's path and sha256.
"""

from __future__ import annotations

import bisect
import os
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from service.services.metric_series import LruCache
from torchyard.contract.archive import MAX_OUTPUTS_FILES, MAX_OUTPUTS_UNCOMPRESSED_BYTES, safe_member_parts
from torchyard.contract.errors import InvalidDatasetError, RequestValidationError

# Uncompressed bytes between two access points: the most decompressed to reach a file.
SPACING = 32 * 1024**2
# Memory of the indexes kept (an access point holds the decompressor's 32 KiB window).
CACHED_BYTES = 128 * 1024**2
_POINT_BYTES = 48 * 1024
_FILE_BYTES = 256
_IN_CHUNK = 256 * 1024
_OUT_CHUNK = 1024 * 1024
# tarfile reads a header record in one piece; more than this is refused.
_MAX_SINGLE_READ = 4 * 1024 * 1024
_GZIP_MAGIC = b"\x1f\x8b"


class ArchiveReadError(Exception):
    """The archive's gzip or tar stream is not what it should be."""


@dataclass(frozen=True)
class _Point:
    """A decompressor that has consumed ``at`` bytes of the file and produced the
    uncompressed stream up to ``out``."""

    out: int
    at: int
    state: zlib._Decompress


@dataclass(frozen=True)
class ArchiveIndex:
    """Each regular file's (offset, size) in the uncompressed stream by its path, the
    access points, and why files cannot be served one by one (None: they can)."""

    files: dict[str, tuple[int, int]]
    points: list[_Point]
    problem: str | None = None

    def cost(self) -> int:
        return len(self.points) * _POINT_BYTES + len(self.files) * _FILE_BYTES


class _Inflater:
    """The uncompressed bytes of a .gz file read forward from an access point (its start
    when None), taking access points every ``spacing`` bytes when asked to. Concatenated
    gzip members and zero padding after the last are read as gzip readers do."""

    def __init__(self, fh: BinaryIO, point: _Point | None, spacing: int | None = None) -> None:
        self._fh = fh
        if point is None:
            point = _Point(0, 0, zlib.decompressobj(16 + zlib.MAX_WBITS))
        fh.seek(point.at)
        self._d = point.state.copy()
        self._consumed = point.at  # compressed bytes the decompressor has taken
        self._pending = b""  # bytes read from the file after those, not given to it yet
        self._produced = point.out  # uncompressed offset after what it has produced
        self._buf = b""
        self._buf_at = 0  # the next byte of _buf to hand out
        self._spacing = spacing
        self.points: list[_Point] = [point] if spacing else []
        self._ended = False

    @property
    def pos(self) -> int:
        return self._produced - (len(self._buf) - self._buf_at)

    def _top_up(self) -> bool:
        """More compressed bytes in ``_pending``; False at the end of the file."""
        data = self._fh.read(_IN_CHUNK)
        self._pending += data
        return bool(data)

    def _next_member(self) -> bool:
        """After a gzip member's end: start the next one; False when only zeros follow."""
        while True:
            stripped = self._pending.lstrip(b"\0")
            self._consumed += len(self._pending) - len(stripped)
            self._pending = stripped
            if len(self._pending) >= 2:
                break
            if not self._top_up():
                if self._pending:
                    raise ArchiveReadError("the archive ends with stray bytes after its gzip data")
                return False
        if not self._pending.startswith(_GZIP_MAGIC):
            raise ArchiveReadError("the archive holds stray bytes after its gzip data")
        self._d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        return True

    def _fill(self) -> bool:
        """Decompress the next piece into the buffer; False at the end of the data."""
        while not self._ended:
            if self._d.eof and not self._next_member():
                self._ended = True
                break
            if not self._pending:
                self._top_up()
            given = self._pending
            try:
                out = self._d.decompress(given, _OUT_CHUNK)
            except zlib.error as exc:
                raise ArchiveReadError(f"the archive's gzip data cannot be read: {exc}") from None
            if not (out or given or self._d.eof):
                raise ArchiveReadError("the archive's gzip data is cut short")
            self._pending = self._d.unused_data if self._d.eof else self._d.unconsumed_tail
            self._consumed += len(given) - len(self._pending)
            self._produced += len(out)
            if self._spacing and not self._d.eof and self._produced - self.points[-1].out >= self._spacing:
                self.points.append(_Point(self._produced, self._consumed, self._d.copy()))
            if out:
                self._buf, self._buf_at = out, 0
                return True
        return False

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or size > _MAX_SINGLE_READ:
            raise ArchiveReadError("the archive holds an oversized header record")
        parts: list[bytes] = []
        wanted = size
        while wanted > 0:
            if self._buf_at >= len(self._buf) and not self._fill():
                break
            piece = self._buf[self._buf_at : self._buf_at + wanted]
            self._buf_at += len(piece)
            wanted -= len(piece)
            parts.append(piece)
        return b"".join(parts)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """Forward only (tarfile walks an archive forward); skipping decompresses."""
        if whence == os.SEEK_CUR:
            offset += self.pos
        elif whence != os.SEEK_SET:
            raise ArchiveReadError("the archive cannot be read from its end")
        if offset < self.pos:
            raise ArchiveReadError("the archive cannot be read backwards")
        while self.pos < offset:
            if self._buf_at >= len(self._buf) and not self._fill():
                break
            self._buf_at = min(len(self._buf), self._buf_at + offset - self.pos)
        return self.pos

    def tell(self) -> int:
        return self.pos


def build_index(
    path: Path,
    *,
    max_entries: int = MAX_OUTPUTS_FILES,
    max_bytes: int = MAX_OUTPUTS_UNCOMPRESSED_BYTES,
    spacing: int = SPACING,
) -> ArchiveIndex:
    """Walk the archive once (see the module's docstring); the first of two members with
    the same path is the one served."""
    files: dict[str, tuple[int, int]] = {}
    entries = total = 0
    with open(path, "rb") as fh:
        inflater = _Inflater(fh, None, spacing)
        try:
            with tarfile.open(fileobj=inflater, mode="r:") as tf:  # type: ignore[call-overload]
                while (member := tf.next()) is not None:
                    tf.members = []  # the walk keeps only what the index needs
                    entries += 1
                    if member.isreg() and not member.issparse():
                        total += member.size
                        files.setdefault(
                            "/".join(safe_member_parts(member.name)), (member.offset_data, member.size)
                        )
                    if entries > max_entries or total > max_bytes:
                        return ArchiveIndex(
                            {},
                            [],
                            f"the outputs archive holds more than {max_entries} entries or {max_bytes} bytes "
                            "once unpacked: download it whole",
                        )
        except (tarfile.TarError, InvalidDatasetError, EOFError) as exc:
            raise ArchiveReadError(f"the outputs archive cannot be read: {exc}") from None
    return ArchiveIndex(files, inflater.points)


def copy_file(path: Path, index: ArchiveIndex, rel: str, out: BinaryIO) -> int:
    """Write the file ``rel`` of the archive to ``out`` from the access point before it;
    its size. ``rel`` must be one of ``index.files``."""
    offset, size = index.files[rel]
    point = index.points[bisect.bisect_right([p.out for p in index.points], offset) - 1]
    with open(path, "rb") as fh:
        inflater = _Inflater(fh, point)
        if inflater.seek(offset) != offset:
            raise ArchiveReadError("the outputs archive is cut short")
        left = size
        while left > 0:
            chunk = inflater.read(min(_OUT_CHUNK, left))
            if not chunk:
                raise ArchiveReadError("the outputs archive is cut short")
            out.write(chunk)
            left -= len(chunk)
    return size


_indexes: LruCache[tuple[str, str], ArchiveIndex] = LruCache(CACHED_BYTES, ArchiveIndex.cost)


def index_of(path: Path, sha256: str) -> ArchiveIndex:
    """The archive's index, from memory or built now (the caller serialises the builds of
    one archive: the job's outputs lock). A 422 when it cannot be read."""
    key = (str(path), sha256)
    index = _indexes.get(key)
    if index is None:
        try:
            index = build_index(path)
        except ArchiveReadError as exc:
            raise RequestValidationError(str(exc)) from None
        _indexes.put(key, index)
    return index
