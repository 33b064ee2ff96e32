"""A script job's outputs archive: the node's outputs folder, with its ./logs and the working
copies' Lightning logs, packed within the archive's bounds and uploaded under the lease."""

from __future__ import annotations

import logging
import os
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from torchyard.contract.archive import MAX_OUTPUTS_FILES, MAX_OUTPUTS_UNCOMPRESSED_BYTES
from torchyard.contract.deflate import GzipWriter, LevelChooser
from torchyard.contract.files import sha256_file
from worker.agent import job_tree
from worker.agent.retry import Deadline

if TYPE_CHECKING:
    from worker.agent.context import AgentContext
    from worker.agent.lease import LeaseSession

log = logging.getLogger(__name__)

# What of a node's ./logs goes into the outputs archive (under ``logs/``): at most this many
# files and bytes in all, each file up to MAX_ARCHIVED_LOG_FILE_BYTES; the rest is named in
# the job's log.
MAX_ARCHIVED_LOG_FILES = 1000
MAX_ARCHIVED_LOG_BYTES = 512 << 20
MAX_ARCHIVED_LOG_FILE_BYTES = 256 << 20
# Lightning's default root folder (``default_root_dir``: the working directory) for its
# loggers and checkpoints: a working copy's is kept in the outputs archive under
# ``lightning_logs/``, at most this many files and bytes (the rest named in the job's log).
LIGHTNING_LOGS = "lightning_logs"
MAX_ARCHIVED_LIGHTNING_FILES = 1000
MAX_ARCHIVED_LIGHTNING_BYTES = 2 << 30


def _regular_files(folder: Path, note: Callable[[str], None], shown: str) -> list[tuple[str, int]]:
    """The regular files under ``folder`` (read through job_tree: no link followed, on the
    way or at the end), by relative path, with their sizes; anything else is named."""
    files = []
    for relative, fh in job_tree.regular_files(folder):
        if fh is None:
            note(f"{shown}{relative} is left out (not a regular file)")
            continue
        files.append((relative, os.fstat(fh.fileno()).st_size))
    return files


def _kept_logs(
    folder: Path, taken: set[str], note: Callable[[str], None]
) -> list[tuple[str, Path, str, int]]:
    """The files of ``folder`` (the node's ./logs) as ``logs/<path>`` members, within the bounds."""
    return _kept_folder(
        folder,
        "logs/",
        taken,
        note,
        MAX_ARCHIVED_LOG_FILES,
        MAX_ARCHIVED_LOG_BYTES,
        MAX_ARCHIVED_LOG_FILE_BYTES,
        "the outputs hold a file of that name",
    )


def _kept_folder(
    folder: Path,
    prefix: str,
    taken: set[str],
    note: Callable[[str], None],
    max_files: int,
    max_bytes: int,
    max_file_bytes: int,
    taken_why: str,
    counted: int = 0,
    counted_bytes: int = 0,
) -> list[tuple[str, Path, str, int]]:
    """The files of ``folder`` as ``<prefix><path>`` members, within the bounds (``counted``
    files and ``counted_bytes`` of the same bounds already taken)."""
    kept: list[tuple[str, Path, str, int]] = []
    total = counted_bytes
    for relative, size in _regular_files(folder, note, prefix):
        name = f"{prefix}{relative}"
        if name in taken:
            note(f"{name} is left out ({taken_why})")
        elif counted + len(kept) >= max_files:
            note(f"{name} is left out (at most {max_files} files of {prefix} are kept)")
        elif size > max_file_bytes:
            note(f"{name} is left out ({size} bytes; a file of {prefix} is kept up to {max_file_bytes})")
        elif total + size > max_bytes:
            note(f"{name} is left out ({prefix} is kept up to {max_bytes} bytes in all)")
        else:
            kept.append((name, folder, relative, size))
            total += size
    return kept


def _kept_lightning_logs(
    folders: Sequence[Path], taken: set[str], note: Callable[[str], None]
) -> list[tuple[str, Path, str, int]]:
    """The files of the working copies' ``lightning_logs`` folders as ``lightning_logs/<path>``
    members, within their bounds (a name already taken, by the outputs or an earlier copy,
    is left out)."""
    kept: list[tuple[str, Path, str, int]] = []
    for folder in folders:
        kept += _kept_folder(
            folder,
            f"{LIGHTNING_LOGS}/",
            taken | {name for name, _, _, _ in kept},
            note,
            MAX_ARCHIVED_LIGHTNING_FILES,
            MAX_ARCHIVED_LIGHTNING_BYTES,
            MAX_ARCHIVED_LIGHTNING_BYTES,
            "the outputs or another working copy hold a file of that name",
            len(kept),
            sum(size for _, _, _, size in kept),
        )
    return kept


def _within_caps(
    members: list[tuple[str, Path, str, int]], max_files: int, max_bytes: int, say: Callable[[str], None]
) -> list[tuple[str, Path, str, int]]:
    """The members that fit the archive's caps, in order; the rest named, in one note."""
    kept: list[tuple[str, Path, str, int]] = []
    total = left_bytes = 0
    left: list[str] = []
    for member in members:
        size = member[3]
        if len(kept) >= max_files or total + size > max_bytes:
            left.append(member[0])
            left_bytes += size
            continue
        kept.append(member)
        total += size
    if left:
        shown = ", ".join(left[:10]) + (f" and {len(left) - 10} more" if len(left) > 10 else "")
        say(
            f"{len(left)} file(s) ({left_bytes} bytes) are left out: the outputs archive holds at most "
            f"{max_files} files and {max_bytes} bytes uncompressed ({shown})"
        )
    return kept


def pack_outputs(
    folder: Path,
    archive: Path,
    logs: Path | None = None,
    note: Callable[[str], None] | None = None,
    *,
    max_files: int = MAX_OUTPUTS_FILES,
    max_bytes: int = MAX_OUTPUTS_UNCOMPRESSED_BYTES,
    lightning_logs: Sequence[Path] = (),
) -> tuple[str, int, int]:
    """A deterministic .tar.gz of the regular files under ``folder``, under ``logs/`` those of
    ``logs`` and under ``lightning_logs/`` those of the ``lightning_logs`` folders (the
    working copies' own) within the bounds above (links and other special files are left
    out, each named through ``note``), at most ``max_files`` files and ``max_bytes`` bytes in
    all (what the API accepts; the outputs first); its sha256, size and file count. The
    files are read through job_tree: the run's folders may hold links to anything of the
    host's."""
    say = note or (lambda text: log.warning("outputs: %s", text))
    found = [(relative, folder, relative, size) for relative, size in _regular_files(folder, say, "")]
    if logs is not None:
        found += _kept_logs(logs, {name for name, _, _, _ in found}, say)
    if lightning_logs:
        found += _kept_lightning_logs(lightning_logs, {name for name, _, _, _ in found}, say)
    members = [(name, root, rel) for name, root, rel, _ in _within_caps(found, max_files, max_bytes, say)]
    levels = LevelChooser()  # weights and images stored, text deflated
    with (
        open(archive, "wb") as raw,
        GzipWriter(raw) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tf,  # type: ignore[call-overload]
    ):
        for name, root, relative in members:
            try:
                fh = job_tree.open_regular(root, relative)
            except OSError as exc:  # gone or swapped since it was listed
                say(f"{name} is left out ({exc})")
                continue
            with fh:
                info = tarfile.TarInfo(name)
                info.size = os.fstat(fh.fileno()).st_size
                gz.set_level(levels.for_open_file(Path(relative).name, fh, info.size))
                info.mode = 0o644
                info.mtime = 0
                tf.addfile(info, fh)
    return sha256_file(archive), archive.stat().st_size, len(members)


def upload_outputs(
    ctx: AgentContext,
    job_id: str,
    lease_token: str,
    folder: Path,
    logs: Path | None = None,
    note: Callable[[str], None] | None = None,
    *,
    outage_deadline: Deadline | None = None,
    archive_dir: Path | None = None,
) -> str:
    """Pack and upload the outputs; an unreachable API is waited for until ``outage_deadline``
    (monotonic), as the other reports wait, so an API restart loses no outputs."""
    from worker.agent.lease import LeaseSession

    session = LeaseSession(ctx.api, job_id, lease_token)
    return upload_outputs_of(
        session, folder, logs, note, outage_deadline=outage_deadline, archive_dir=archive_dir
    )


def upload_outputs_of(
    session: LeaseSession,
    folder: Path,
    logs: Path | None = None,
    note: Callable[[str], None] | None = None,
    *,
    outage_deadline: Deadline | None = None,
    archive_dir: Path | None = None,
    lightning_logs: Sequence[Path] = (),
) -> str:
    """Pack the outputs (and ``logs``, and the ``lightning_logs`` folders) into ``archive_dir``
    (the agent's folder of the placement; beside ``folder`` by default) and upload them under
    the session's lease; the archive's sha256."""
    archive = (archive_dir or folder.parent) / "outputs.tar.gz"
    try:
        sha256, size, count = pack_outputs(folder, archive, logs, note, lightning_logs=lightning_logs)
        session.upload_outputs(
            archive,
            sha256,
            size,
            f"job {session.job_id}: outputs ({count} files)",
            outage_deadline=outage_deadline,
        )
    finally:
        archive.unlink(missing_ok=True)
    return sha256
