"""The processes of one run, found by a marker variable in their environment.

torchrun runs in a session of its own and starts every rank in yet another session, and a
script's processes each lead a session too, so the processes of a run are found by the
marker variable (``TORCHYARD_RUN_MARKER``) in their environment, read from ``/proc``; the
marker starts with a scope of the agent (its node name and work directory), so a restarted
agent finds what its predecessor left.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger(__name__)

MARKER_VAR = "TORCHYARD_RUN_MARKER"


def marked_pids(marker: str, *, prefix: bool = False) -> list[int]:
    """Live processes (of this user) whose environment carries ``marker`` (or, with
    ``prefix``, a marker starting with it)."""
    needle = f"{MARKER_VAR}={marker}".encode() + (b"" if prefix else b"\0")
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                data = fh.read()
        except OSError:  # gone, or not ours
            continue
        if data.startswith(needle) or b"\0" + needle in data:
            found.append(int(entry.name))
    return [pid for pid in found if pid != os.getpid()]


def signal_pids(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:  # pragma: no cover - the pid was reused by someone else
            pass


def kill_marked(marker: str, what: str, timeout: float = 5.0) -> list[int]:
    """SIGKILL the live processes carrying ``marker`` (those of ``what``, for the log) and
    wait, ``timeout`` at most, until they are gone; their pids."""
    left = marked_pids(marker)
    if not left:
        return []
    log.warning("killing %d leftover process(es) of %s: %s", len(left), what, left)
    signal_pids(left, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while marked_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def marker_scope(node_name: str, work_dir: Path) -> str:
    """The marker prefix of one agent's runs: its node name and work directory.

    A restarted agent (same name, same work directory) finds what its predecessor left;
    another agent on the same machine — a second demo, a test — never matches it.
    """
    digest = hashlib.sha256(str(work_dir.resolve()).encode()).hexdigest()[:12]
    return f"{node_name}@{digest}/"


def kill_leftovers(node_name: str, work_dir: Path) -> list[int]:
    """Kill processes left by an earlier agent of this node (one that was itself killed)."""
    pids = marked_pids(marker_scope(node_name, work_dir), prefix=True)
    if pids:
        log.warning(
            "killing %d process(es) left by an earlier agent of node %s: %s", len(pids), node_name, pids
        )
        signal_pids(pids, signal.SIGKILL)
    return pids
