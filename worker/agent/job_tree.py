"""Reading what a run's processes wrote, without following anything they put there.

A run's directory is the one folder its sandboxed processes can write: any name in it may
become a symbolic link, a FIFO, a device node or a folder between two looks, and the agent
reading it is often root. So the agent reads that tree only through this module:

- a file is opened once, relative to directory descriptors, one component at a time, each
  with ``O_NOFOLLOW`` (a link anywhere on the way fails the open), the file itself with
  ``O_NONBLOCK`` too (a FIFO cannot block the agent), then checked with ``fstat`` to be a
  regular file; the agent keeps reading from that descriptor, so a later swap of the name
  changes nothing it reads;
- folders are walked with :func:`os.fwalk` without following links, and each file is
  opened relative to its folder's descriptor the same way.

The agent's own files (its log of the placement, the processes' stdout, the MLflow and
TensorBoard metric files it writes) live outside that tree
(:attr:`worker.agent.context.AgentContext.placements_dir`), where nothing of the run can
reach them.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import BinaryIO

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NotRegularFileError(OSError):
    """The name is (or leads through) something other than folders and a regular file."""


def _parts(relative: str | PurePosixPath) -> list[str]:
    parts = [p for p in PurePosixPath(relative).parts if p not in ("", ".")]
    if not parts or any(p in ("..", "/") for p in parts):
        raise NotRegularFileError(f"not a path inside the run's folder: {relative}")
    return parts


def open_regular(root: Path, relative: str | PurePosixPath) -> BinaryIO:
    """``root/relative`` opened for reading, following no link on the way nor at the end,
    without blocking, and only if it is a regular file.

    Raises FileNotFoundError when a component is missing, :class:`NotRegularFileError` when
    something on the way is a link, a FIFO, a device, or the last component is no regular
    file."""
    parts = _parts(relative)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            try:
                following = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if isinstance(exc, FileNotFoundError):
                    raise
                raise NotRegularFileError(f"{part}: not a folder") from exc
            os.close(fd)
            fd = following
        return open_at(fd, parts[-1])
    finally:
        os.close(fd)


def open_at(dir_fd: int, name: str) -> BinaryIO:
    """``name`` in the folder ``dir_fd``, as :func:`open_regular` opens its last component."""
    try:
        # Looked at before it is opened: a device node is never opened at all.
        if not stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise NotRegularFileError(f"{name}: not a regular file")
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    except NotRegularFileError:
        raise
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise NotRegularFileError(f"{name}: not a regular file ({exc.strerror})") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFileError(f"{name}: not a regular file")
        # Reads of a regular file never block; the flag only guarded the open.
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_in(path: Path, root: Path | None) -> BinaryIO:
    """``path`` opened as :func:`open_regular` does: beneath ``root`` when it lies there (the
    run's tree), else on its own (a file of the agent's, still never through a link)."""
    if root is not None:
        with contextlib.suppress(ValueError):
            return open_regular(root, path.relative_to(root).as_posix())
    return open_regular(path.parent, path.name)


def regular_files(folder: Path) -> Iterator[tuple[str, BinaryIO | None]]:
    """Every file under ``folder`` (not following links, ``folder`` itself included), by its
    path relative to ``folder``, sorted: an open regular file, or None for anything else (a
    link, a FIFO, a device), which the caller names as left out. The file is closed once
    the caller moves on."""
    try:
        top = os.lstat(folder)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(top.st_mode):
        return
    for dirpath, dirnames, filenames, dir_fd in os.fwalk(folder, follow_symlinks=False):
        dirnames.sort()
        relative_dir = Path(dirpath).relative_to(folder)
        # Links to folders are listed with the folders by fwalk: they are left out too.
        names = sorted(filenames + [d for d in dirnames if _is_link(d, dir_fd)])
        dirnames[:] = [d for d in dirnames if not _is_link(d, dir_fd)]
        for name in names:
            relative = (relative_dir / name).as_posix()
            try:
                fh = open_at(dir_fd, name)
            except (NotRegularFileError, FileNotFoundError):
                yield relative, None
                continue
            with fh:
                yield relative, fh


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def give_to(root: Path, uid: int, gid: int, keep: Iterable[Path] = ()) -> None:
    """Make ``root`` and everything under it (links themselves, never their targets) owned by
    ``uid``:``gid``: the tree the run's unprivileged processes write. Folders in ``keep``
    (inputs hard-linked from the node's cache) keep their owner: a hard link shares it."""
    kept = {Path(p).absolute() for p in keep}
    os.chown(root, uid, gid, follow_symlinks=False)
    for dirpath, dirnames, filenames, dir_fd in os.fwalk(root, follow_symlinks=False):
        dirnames[:] = [d for d in dirnames if (Path(dirpath) / d).absolute() not in kept]
        for name in dirnames + filenames:
            if (Path(dirpath) / name).absolute() in kept:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
