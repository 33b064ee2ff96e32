"""The agent's side of what the ranks leave in the run directory for it: progress marks
(the hang watchdog), the preemption request and its answer.

The file names are those of the trainer's ``worker/trainer/control.py`` (the agent does
not import the trainer, which needs torch).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

from torchyard.contract.errors import HangError
from torchyard.contract.failures import FailureReport
from worker.agent import job_tree
from worker.agent.rank_group import LaunchSpec

PREEMPT_REQUEST_FILE = "preempt-request"
PREEMPTED_FILE = "preempted.json"
PROGRESS_PREFIX = "progress-rank-"
STACK_DUMP_SIGNAL = signal.SIGUSR1
PREEMPT_GRACE_ENV = "TORCHYARD_PREEMPT_GRACE_S"
DEFAULT_PREEMPT_GRACE_S = 30.0
# Time for every rank to write its stacks after the dump signal.
DUMP_WAIT_S = 3.0
_CHECK_EVERY_S = 1.0


def preempt_grace_s() -> float:
    """``TORCHYARD_PREEMPT_GRACE_S`` (default 30): how long preempted ranks have to
    checkpoint and stop before they are killed."""
    raw = os.environ.get(PREEMPT_GRACE_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_PREEMPT_GRACE_S
    except ValueError:
        value = DEFAULT_PREEMPT_GRACE_S
    return value if value > 0 else DEFAULT_PREEMPT_GRACE_S


def _process_state(pid: int) -> str | None:
    """The one-letter state of ``/proc/<pid>/stat`` (R, S, D, T...), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    return text.rpartition(")")[2].split()[0] if ")" in text else None


def _status_fields(pid: int) -> tuple[int, list[int]] | None:
    """(parent pid, the NSpid chain: this namespace's pid first, the innermost last) of a process."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return None
    ppid, nspids = 0, [pid]
    for line in text.splitlines():
        if line.startswith("PPid:"):
            ppid = int(line.split()[1])
        elif line.startswith("NSpid:"):
            nspids = [int(v) for v in line.split()[1:]]
    return ppid, nspids


def host_pid(inner: int, root: int) -> int | None:
    """The pid, in the agent's PID namespace, of the process under ``root`` (the run's torchrun
    or its sandbox) whose own pid is ``inner``: the ranks run in the sandbox's PID namespace and
    write the pid they see there, which means another process out here (never signal that)."""
    parents: dict[int, int] = {}
    candidates = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _status_fields(int(entry.name))
        if fields is None:
            continue
        parents[int(entry.name)] = fields[0]
        if fields[1][-1] == inner:
            candidates.append(int(entry.name))
    for pid in candidates:
        ancestor = pid
        for _ in range(64):  # walk up to the run's root (or the top)
            if ancestor == root:
                return pid
            ancestor = parents.get(ancestor, 0)
            if ancestor <= 1:
                break
    return None


_STATES = {
    "T": "stopped by a signal",
    "t": "stopped by a debugger",
    "D": "in uninterruptible I/O",
    "Z": "exited",
}


class HangWatchdog:
    """No rank of this node finished a training step (or validation batch) for
    ``timeout_s``: the attempt is hung. Ranks mark progress by touching
    ``progress-rank-<R>`` (which holds their pid). A rank creates that file once its
    set-up is done (process group, data, model), so the watchdog counts from there:
    start-up has its own bounds (the rendezvous and process-group timeouts)."""

    def __init__(
        self,
        run_dir: Path,
        timeout_s: float,
        spec: LaunchSpec,
        log: logging.Logger,
        root_pid: int | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        # The run's top process (torchrun, or the sandbox around it): a rank's pid as written in
        # its progress file is looked up under it (see :func:`host_pid`).
        self.root_pid = root_pid
        self.timeout_s = timeout_s
        self.spec = spec
        self.log = log
        self._next_check = 0.0
        self.ranks = [spec.node_rank * spec.nproc + local for local in range(spec.nproc)]

    def _marks(self, *, pids: bool = False) -> dict[int, tuple[float, int | None]]:
        """Each rank's last progress time and (with ``pids``, looked up in this namespace) pid;
        ranks without a mark are left out."""
        found: dict[int, tuple[float, int | None]] = {}
        for rank in self.ranks:
            try:
                with job_tree.open_regular(self.run_dir, f"{PROGRESS_PREFIX}{rank}") as fh:
                    mtime = os.fstat(fh.fileno()).st_mtime
                    text = fh.read(64).decode("ascii").strip()
            except (OSError, ValueError):
                continue
            pid = int(text) if text.isdecimal() else None
            if pid is not None and not pids:
                pid = None
            elif pid is not None and self.root_pid is not None:
                pid = host_pid(pid, self.root_pid)
            found[rank] = (mtime, pid)
        return found

    def check(self) -> FailureReport | None:
        """The ``HangError`` failure to report when the ranks are hung, else None."""
        now = time.time()
        if time.monotonic() < self._next_check:
            return None
        self._next_check = time.monotonic() + _CHECK_EVERY_S
        marks = self._marks()
        if not marks:
            return None  # still setting up
        latest = max(t for t, _ in marks.values())
        if now - latest < self.timeout_s:
            return None
        marks = self._marks(pids=True)
        parts = []
        for rank in self.ranks:
            mark = marks.get(rank)
            if mark is None:
                parts.append(f"rank {rank}: still setting up")
                continue
            seen, pid = mark
            state = _process_state(pid) if pid is not None else None
            detail = f", {_STATES[state]}" if state in _STATES else ""
            parts.append(f"rank {rank}: last progress {now - seen:.0f} s ago{detail}")
        message = (
            f"no training step finished on node {self.spec.node_name} for {self.timeout_s:g} s "
            f"(resources.hang_timeout_s): ranks {', '.join(str(r) for r in self.ranks)} stuck "
            f"({'; '.join(parts)}). Their Python stacks are in their logs."
        )
        self.log.error("HangError: %s", message)
        return FailureReport(
            code=HangError.code,
            message=message,
            rank=self.ranks[0] if len(self.ranks) == 1 else None,
            node=self.spec.node_name,
        )

    def dump_stacks(self) -> None:
        """Every rank writes all its threads' Python stacks into its log (faulthandler on
        SIGUSR1); a stopped rank is continued so it can."""
        pids = [pid for _, pid in self._marks(pids=True).values() if pid is not None]
        for pid in pids:
            for sig in (STACK_DUMP_SIGNAL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    break
        self.log.info("asked %d rank(s) for their Python stacks", len(pids))
        time.sleep(DUMP_WAIT_S)
