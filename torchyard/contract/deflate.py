"""A ``.gz`` stream that deflates only what compresses: archives of weights and images.

Model weights (``.safetensors``, ``.onnx``, checkpoints) and encoded images barely
compress: a ResNet-18's 45 MB of weights shrink by 7 % at gzip level 1 for a second of
CPU, and level 6 or 9 spends more for no more (``bench/RESULTS.md``). Text (logs, JSON,
CSV, code) shrinks several times for little CPU. :class:`GzipWriter` writes one ordinary
gzip member whose deflate stream changes level between files: each level's part is a
fresh deflate stream ended with a full flush, and such parts concatenate into one valid
stream (nothing in a part refers back past its start). Every gzip reader reads it,
``tarfile``'s ``r|gz`` streaming mode included.

:class:`LevelChooser` picks a file's level: stored (level 0) when a sample of it
deflates to more than :data:`STORE_ABOVE` of its size at level 1, else the archive's
level. The sample is :data:`SAMPLE_BYTES` from the middle of a file (past any header),
or the first of a stream's; files smaller than :data:`MIN_SAMPLE_BYTES` take the level
chosen for their suffix, decided by the first file of that suffix large enough to tell
(the archive's level until then).

The output is deterministic: the same files give the same bytes.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import IO

SAMPLE_BYTES = 256 * 1024
MIN_SAMPLE_BYTES = 4 * 1024
# Level 1 leaves more than 85 % of the sample: store it. Float weights leave 90-93 % (a
# safetensors header's JSON can take the very first bytes lower), encoded images 99 %+, text
# and logs under half.
STORE_ABOVE = 0.85
DEFAULT_LEVEL = 6
# The gzip header: magic, deflate, no flags, mtime 0 (reproducible), no extra flags, OS unknown.
_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"


def stores_better(sample: bytes) -> bool:
    """Whether ``sample`` barely deflates (store it rather than spend CPU on it)."""
    return len(sample) > 0 and len(zlib.compress(sample, 1)) > STORE_ABOVE * len(sample)


class LevelChooser:
    """The deflate level of each file of one archive (the module's docstring)."""

    def __init__(self, level: int = DEFAULT_LEVEL) -> None:
        self.level = level
        self._by_suffix: dict[str, int] = {}

    def for_head(self, name: str, head: bytes, size: int) -> int:
        """The level for a file called ``name`` of ``size`` bytes, from ``head``: a sample of
        its bytes (its first ones, when it is read as a stream)."""
        suffix = Path(name).suffix.lower()
        if min(size, len(head)) < MIN_SAMPLE_BYTES:
            return self._by_suffix.get(suffix, self.level)
        level = 0 if stores_better(head[:SAMPLE_BYTES]) else self.level
        self._by_suffix.setdefault(suffix, level)
        return level

    def for_file(self, path: Path, size: int) -> int:
        """The level for the file at ``path`` (of ``size`` bytes)."""
        with open(path, "rb") as fh:
            return self.for_open_file(path.name, fh, size)

    def for_open_file(self, name: str, fh: IO[bytes], size: int) -> int:
        """The level for the open file ``fh`` named ``name`` (of ``size`` bytes); its
        position is left where it was."""
        if size < MIN_SAMPLE_BYTES:
            return self.for_head(name, b"", size)
        sample = os.pread(fh.fileno(), SAMPLE_BYTES, max(0, size // 2 - SAMPLE_BYTES // 2))
        return self.for_head(name, sample, size)


class GzipWriter:
    """A write-only gzip stream over ``raw`` whose deflate level can change between writes;
    :meth:`close` ends the member (``raw`` stays open). ``tell`` counts uncompressed bytes,
    as :class:`gzip.GzipFile`'s does, for :mod:`tarfile`."""

    def __init__(self, raw: IO[bytes], level: int = DEFAULT_LEVEL) -> None:
        self._raw = raw
        self._crc = 0
        self._size = 0
        self._level = level
        self._deflate = self._new(level)
        self._pending = False  # data given to the current part since it started
        self.closed = False
        raw.write(_HEADER)

    @staticmethod
    def _new(level: int) -> zlib._Compress:
        return zlib.compressobj(level, zlib.DEFLATED, -zlib.MAX_WBITS)

    def set_level(self, level: int) -> None:
        """Deflate what is written from now on at ``level`` (0: stored)."""
        if level == self._level:
            return
        if self._pending:
            self._raw.write(self._deflate.flush(zlib.Z_FULL_FLUSH))
        self._deflate = self._new(level)
        self._level = level
        self._pending = False

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        if not view.nbytes:
            return 0
        self._crc = zlib.crc32(view, self._crc)
        self._size += view.nbytes
        self._pending = True
        out = self._deflate.compress(view)
        if out:
            self._raw.write(out)
        return view.nbytes

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        pass  # the deflate stream flushes at level changes and at close only

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._raw.write(self._deflate.flush(zlib.Z_FINISH))
        self._raw.write(struct.pack("<II", self._crc, self._size & 0xFFFFFFFF))

    def __enter__(self) -> GzipWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
