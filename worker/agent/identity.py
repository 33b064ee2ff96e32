"""Who this agent is to the API: one live agent per node name and work directory, and a
per-node key that proves to the API that a heartbeat comes from the agent holding the node.

The key is kept in the work directory (mode 0600), so an agent restarted there takes its
node back at once; a second agent started by mistake with the same ``--name`` elsewhere
has another key and is refused by the API while the first one heartbeats. Two agents of
one name in one work directory are stopped earlier, by a lock on a file beside the key.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import time
from pathlib import Path

from torchyard.contract.errors import NodeNameInUseError

log = logging.getLogger(__name__)


def _stem(node_name: str) -> str:
    return "node-" + re.sub(r"[^A-Za-z0-9._-]", "_", node_name)


def agent_key_path(work_dir: Path, node_name: str) -> Path:
    return work_dir / f"{_stem(node_name)}.key"


def load_or_create_agent_key(work_dir: Path, node_name: str) -> str:
    """The node's key in ``work_dir``, created (mode 0600) the first time."""
    path = agent_key_path(work_dir, node_name)
    try:
        key = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        key = ""
    if len(key) >= 32:
        return key
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, (secrets.token_urlsafe(32) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        if key:  # too short to be ours: replace it
            os.replace(tmp, path)
        else:
            # link() fails if another agent created the key meanwhile: then that one counts.
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return path.read_text(encoding="ascii").strip()


class NodeLock:
    """An exclusive lock on ``<work dir>/node-<name>.lock`` held for the agent's life; the
    kernel releases it when the agent dies, however it dies."""

    def __init__(self, work_dir: Path, node_name: str) -> None:
        self.path = work_dir / f"{_stem(node_name)}.lock"
        self.node_name = node_name
        self._fd: int | None = None

    def acquire(self, wait_s: float = 0.0) -> None:
        """Take the lock; with ``wait_s``, wait up to that long for the agent holding it
        to end (an earlier agent of this node still stopping its runs), else refuse."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + wait_s
        waiting = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                if time.monotonic() < deadline:
                    if not waiting:
                        log.warning(
                            "the earlier agent of node %s (pid %s) is still stopping: waiting up to %.0f s for it",
                            self.node_name,
                            holder,
                            wait_s,
                        )
                        waiting = True
                    time.sleep(0.2)
                    continue
            os.close(fd)
            raise NodeNameInUseError(
                f"another agent of node {self.node_name!r} is running with work directory "
                f"{self.path.parent} (pid {holder}); stop it first, or start this one with another "
                "--name and --work-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None
