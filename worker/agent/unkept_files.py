"""The files a script's processes wrote in their working copies and that are not kept with
the job: named in the job's log when the processes end."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Collection
from pathlib import Path

from worker.agent import job_tree

# Files that look like a model a script meant to keep: of the files written in a working
# copy (not kept, only outputs/ and logs/ are, each named in the job's log) they are named
# first when there are too many to name each.
MODEL_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors", ".onnx")
# The files written in a working copy are named one a line up to this many; past it, a
# count, their size and the first few names.
MAX_UNKEPT_NAMED = 20
_UNKEPT_SHOWN = 5
# At most this many files of a working copy are looked at when it ends.
MAX_UNKEPT_SCANNED = 100_000


def name_unkept_files(
    copies: list[Path], code_dir: Path | None, kept: Collection[str], job_log: logging.Logger
) -> list[str]:
    """Say in ``job_log`` which files the processes wrote in their working copies (not
    under outputs/ and logs/, which are links to the kept folders, nor under the top
    folders in ``kept``, which the outputs archive takes): they are not kept. A file the
    code package brought, unchanged, was not written. One line a file, or past
    MAX_UNKEPT_NAMED one line a working copy; the files as ``<copy>/<path>``."""
    found: list[str] = []
    kept_names = ["outputs/", "logs/", *(f"{k}/" for k in kept)]
    also = ", ".join(kept_names[:-1]) + " and " + kept_names[-1]
    for cwd in copies:
        written, scanned_all = _written_files(cwd, code_dir, set(kept))
        found += [f"{cwd.name}/{relative}" for relative, _ in written]
        if not written:
            continue
        if len(written) <= MAX_UNKEPT_NAMED:
            for relative, _size in written:
                job_log.warning(
                    "not kept: %s was written in the working copy of %s, not under outputs/ "
                    "(only %s are kept with the job)",
                    relative,
                    cwd.name,
                    also,
                )
            continue
        models = [r for r, _ in written if r.lower().endswith(MODEL_SUFFIXES)]
        first = list(dict.fromkeys([*models, *(r for r, _ in written)]))[:_UNKEPT_SHOWN]
        job_log.warning(
            "not kept: %s%d files (%s) were written in the working copy of %s, not under outputs/ "
            "(only %s are kept with the job), among them %s",
            "" if scanned_all else "at least ",
            len(written),
            _size_text(sum(size for _, size in written)),
            cwd.name,
            also,
            ", ".join(first),
        )
    return found


def _size_text(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n} bytes" if n != 1 else "1 byte"


def _written_files(cwd: Path, code_dir: Path | None, kept: set[str]) -> tuple[list[tuple[str, int]], bool]:
    """The regular files of a working copy (no link followed) that its code package did not
    bring as they are, by path, with their sizes; and whether every file was looked at (at
    most MAX_UNKEPT_SCANNED are). ``__pycache__`` folders and the top folders in ``kept``
    are left out."""
    written: list[tuple[str, int]] = []
    scanned = 0
    try:
        if not stat.S_ISDIR(os.lstat(cwd).st_mode):
            return written, True
        for folder, dirs, names, dir_fd in os.fwalk(cwd, follow_symlinks=False):
            under = Path(folder).relative_to(cwd)
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not (under == Path(".") and d in kept))
            for name in sorted(names):
                scanned += 1
                if scanned > MAX_UNKEPT_SCANNED:
                    return written, False
                with contextlib.suppress(OSError):
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    relative = (under / name).as_posix()
                    if stat.S_ISREG(st.st_mode) and not _brought(code_dir, relative, st, dir_fd, name):
                        written.append((relative, st.st_size))
    except OSError:
        pass  # the copy went away (or was made unreadable)
    return written, True


def _brought(code_dir: Path | None, relative: str, st: os.stat_result, dir_fd: int, name: str) -> bool:
    """Whether a working copy's file is its code package's, unchanged: the same size, and the
    same modification time (the copy keeps it) or the same bytes."""
    if code_dir is None:
        return False
    try:
        package = os.stat(code_dir / relative, follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISREG(package.st_mode) or package.st_size != st.st_size:
        return False
    if package.st_mtime_ns == st.st_mtime_ns:
        return True
    with job_tree.open_at(dir_fd, name) as copy, open(code_dir / relative, "rb") as original:
        while True:
            a, b = copy.read(1 << 20), original.read(1 << 20)
            if a != b:
                return False
            if not a:
                return True
