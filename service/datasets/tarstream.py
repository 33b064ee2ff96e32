"""A deterministic, streamed tar of a dataset's files, for shipping datasets to workers.

The same files always give the same bytes: members in sorted order, regular files
only, fixed mode/owner/time. The total size is known before the first byte is sent,
so the response can carry a Content-Length and a truncated transfer is detectable.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from torchyard.contract.errors import InvalidDatasetError

_BLOCK = tarfile.BLOCKSIZE
_CHUNK = 1024 * 1024
_END = bytes(2 * _BLOCK)


@dataclass(frozen=True)
class _Member:
    rel: str
    size: int
    header_size: int  # headers are rebuilt while streaming rather than kept for every file


def _header(rel: str, size: int) -> bytes:
    info = tarfile.TarInfo(rel)
    info.size = size
    info.mode = 0o644
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _padding(size: int) -> int:
    return -size % _BLOCK


class DatasetTar:
    """The tar of ``files`` (sorted relative paths) below ``root``: its size, then its bytes."""

    def __init__(self, root: Path, files: Sequence[str]) -> None:
        self.root = Path(root)
        self.members = []
        for rel in sorted(files):
            size = (self.root / rel).stat().st_size
            self.members.append(_Member(rel, size, len(_header(rel, size))))

    @property
    def size(self) -> int:
        return sum(m.header_size + m.size + _padding(m.size) for m in self.members) + len(_END)

    def __iter__(self) -> Iterator[bytes]:
        for m in self.members:
            yield _header(m.rel, m.size)
            left = m.size
            with open(self.root / m.rel, "rb") as f:
                while left > 0:
                    chunk = f.read(min(_CHUNK, left))
                    if not chunk:
                        # The file shrank since it was listed: stop here; the receiver sees a
                        # short body (Content-Length) rather than a silently different tar.
                        raise InvalidDatasetError(f"dataset file {m.rel!r} changed while it was being sent")
                    left -= len(chunk)
                    yield chunk
            if pad := _padding(m.size):
                yield bytes(pad)
        yield _END
