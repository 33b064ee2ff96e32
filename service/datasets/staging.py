"""The staging area of dataset uploads: one locked folder per upload, a per-user cap on
uploads in progress, and the clean-up of what interrupted uploads left behind.

Each upload gets a folder of its own in the staging folder; the uploaded file and its
extraction are written there, and the folder is removed when the request ends. While it
is in use, the process using it holds a lock on it (``flock`` on the folder) and also
remembers it. A clean-up removes every entry of the staging folder that is neither in use
by this process nor locked by another one: a process killed in the middle of an upload
loses its locks with it, so what it left behind goes at the next clean-up. Every API
process cleans up when it starts and then periodically.

A user's uploads take numbered slots, folders ``u-<user>.<n>`` for ``n`` below the cap:
holding a slot's lock is what makes it taken, so the cap counts the uploads of every
API process that shares the data directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from starlette.concurrency import run_in_threadpool

from torchyard.contract.errors import ConflictError

log = logging.getLogger(__name__)

# Entries of the staging folder in use by this process. The clean-up skips them without
# opening them: where flock is emulated with POSIX locks (NFS), closing any descriptor of
# a folder would drop this process's lock on it.
_in_use: set[str] = set()
_in_use_lock = threading.Lock()
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def _claim(name: str) -> bool:
    with _in_use_lock:
        if name in _in_use:
            return False
        _in_use.add(name)
        return True


def _release(name: str) -> None:
    with _in_use_lock:
        _in_use.discard(name)


def _lock_folder(path: Path) -> int | None:
    """An open descriptor of ``path`` holding its exclusive lock, or None when another
    process holds it or the folder is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _is_open_at(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the folder open as ``fd`` (a clean-up may have moved it)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _discard(path: Path) -> None:
    """Remove a folder that nobody uses: renamed away at once, deleted in the background."""
    trash = path.with_name(f"stale-{uuid.uuid4().hex}")
    try:
        os.rename(path, trash)
    except OSError:
        return
    threading.Thread(target=shutil.rmtree, args=(trash, True), name="staging-discard", daemon=True).start()


def _take(staging: Path, name: str) -> int | None:
    """Create and lock the folder ``staging/name``; None when it is in use."""
    if not _claim(name):
        return None
    try:
        path = staging / name
        for _ in range(8):
            try:
                path.mkdir(mode=0o700)
                fresh = True
            except FileExistsError:
                fresh = False
            fd = _lock_folder(path)
            if fd is None:
                if path.exists():
                    break  # another process holds it
                continue  # swept away between mkdir and open
            if not _is_open_at(fd, path):
                os.close(fd)
                continue
            if not fresh:
                # Left by a process that stopped in the middle of an upload.
                _discard(path)
                os.close(fd)
                continue
            return fd
    except BaseException:
        _release(name)
        raise
    _release(name)
    return None


@contextmanager
def workspace(
    staging: Path, *, owner: str | None = None, max_per_owner: int = 1, what: str = "dataset"
) -> Iterator[Path]:
    """A new, empty folder in ``staging``, locked while the block runs and removed after it.

    With ``owner``, the folder is one of that owner's ``max_per_owner`` slots; when all of
    them are in use (by any process sharing ``staging``), ConflictError (409).
    """
    staging.mkdir(parents=True, exist_ok=True)
    if owner is None:
        names = [f"w-{uuid.uuid4().hex}"]
    else:
        key = _UNSAFE.sub("_", owner)
        names = [f"u-{key}.{n}" for n in range(max_per_owner)]
    for name in names:
        fd = _take(staging, name)
        if fd is not None:
            break
    else:
        raise ConflictError(
            f"{max_per_owner} {what} upload(s) of yours are already in progress, the most allowed "
            "at once (TORCHYARD_MAX_CONCURRENT_UPLOADS_PER_USER); try again when one has finished",
            details={"limit": max_per_owner},
        )
    path = staging / name
    try:
        yield path
    finally:
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
            _release(name)


def remove_interrupted(staging: Path) -> list[str]:
    """Remove what no upload uses any more from ``staging``; the names removed."""
    try:
        entries = list(os.scandir(staging))
    except FileNotFoundError:
        return []
    removed = []
    for entry in entries:
        with _in_use_lock:
            if entry.name in _in_use:
                continue
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            fd = _lock_folder(path)
            if fd is None:
                continue  # in use by another process (or gone already)
            try:
                trash = staging / f"swept-{uuid.uuid4().hex}"
                try:
                    os.rename(path, trash)
                except OSError:
                    continue
            finally:
                os.close(fd)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        removed.append(entry.name)
    if removed:
        log.info(
            "removed %d leftover(s) of interrupted uploads from %s: %s", len(removed), staging, removed[:10]
        )
    return removed


async def remove_interrupted_periodically(
    staging: Path | list[Path], interval_s: float, stop: asyncio.Event
) -> None:
    """Sweep ``staging`` (one folder or several) now, then every ``interval_s`` seconds until
    ``stop`` is set."""
    folders = staging if isinstance(staging, list) else [staging]
    while True:
        for folder in folders:
            try:
                await run_in_threadpool(remove_interrupted, folder)
            except OSError as exc:
                log.warning("could not clean the staging folder %s: %s", folder, exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
        if stop.is_set():
            return
