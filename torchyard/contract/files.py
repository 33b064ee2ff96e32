"""File helpers every process shares: a file's sha256 and an exclusive lock on a lock file.

Plain Python (no framework): the API service, the worker agent, the trainer and the CLI
hash and lock the same way.
"""

from __future__ import annotations

import fcntl
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

CHUNK = 1 << 20


def sha256_fileobj(fh: IO[bytes], *, rewind: bool = False) -> str:
    """The sha256 of what is left to read of ``fh`` (all of it with ``rewind``), in chunks."""
    if rewind:
        fh.seek(0)
    digest = hashlib.sha256()
    while chunk := fh.read(CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: str | Path) -> str:
    """The sha256 of a file's bytes, read in chunks."""
    with open(path, "rb") as fh:
        return sha256_fileobj(fh)


@contextmanager
def locked(path: str | Path, *, blocking: bool = True) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the file ``path`` (created if missing) for the block.

    ``blocking=False``: raise :class:`BlockingIOError` at once when another process holds it.
    """
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX if blocking else fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
