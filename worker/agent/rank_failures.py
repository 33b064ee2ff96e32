"""What the agent reports when a node's ranks end badly: the root cause among the ranks'
failure files and torchrun's own report (its output, where the placement's log has it),
and the rank logs torchrun wrote."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

from torchyard.contract.errors import CommunicationError, RankFailedError, RankKilledError
from torchyard.contract.failures import MAX_FAILURE_MESSAGE, FailureReport
from worker.agent import job_tree
from worker.agent.rank_group import LaunchSpec

TRACEBACK_TAIL_LINES = 40


def rank_log_files(spec: LaunchSpec) -> list[tuple[str, Path]]:
    """``(stream, path)`` of every rank log torchrun wrote so far (stdout and stderr feed one stream)."""
    found = []
    for path in sorted(spec.log_dir.glob("**/attempt_*/*/std*.log")):
        local = path.parent.name
        if not local.isdigit() or path.name not in ("stdout.log", "stderr.log"):
            continue
        global_rank = spec.node_rank * spec.nproc + int(local)
        found.append((f"rank-{global_rank}", path))
    return found


def tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            fh.seek(max(0, size - 64 * 1024))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def read_failure_files(run_dir: Path) -> list[dict[str, Any]]:
    records = []
    for path in run_dir.glob("failure-rank-*.json"):
        try:
            with job_tree.open_regular(run_dir, path.name) as fh:
                record = json.loads(fh.read(1 << 20).decode("utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("code"), str):
            records.append(record)
    return records


def first_failure(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The root cause: the earliest failure that is not a consequence of another one."""
    if not records:
        return None

    def key(r: dict[str, Any]) -> tuple[bool, float, int]:
        t = r.get("time")
        rank = r.get("rank")
        return (
            bool(r.get("secondary")),
            float(t) if isinstance(t, int | float) else float("inf"),
            rank if isinstance(rank, int) else 1 << 30,
        )

    return min(records, key=key)


_ROOT_CAUSE = re.compile(
    r"Root Cause.*?rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*exitcode\s*:\s*(-?\d+)", re.S
)


def root_cause(torchrun_output: Path) -> tuple[int, int, int] | None:
    """torchrun's "Root Cause (first observed failure)": global rank, local rank, exit code."""
    matches = list(_ROOT_CAUSE.finditer(tail(torchrun_output, 400)))
    if not matches:
        return None
    last = matches[-1]
    return int(last.group(1)), int(last.group(2)), int(last.group(3))


_FAILURE_ENTRY = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*exitcode\s*:\s*(-?\d+)")


def _killed_rank(torchrun_output: Path) -> tuple[int, int, int] | None:
    """A rank of torchrun's failure report (its "Failures" or its root cause) killed by
    a signal from outside. torchrun names as root cause the failure it dates first, to
    the second: a peer whose collective broke under the killed rank may come first."""
    for match in _FAILURE_ENTRY.finditer(tail(torchrun_output, 400)):
        entry = int(match.group(1)), int(match.group(2)), int(match.group(3))
        if _killed_from_outside(entry[2]):
            return entry
    return None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


# torchrun's own words for a rendezvous that could not form or broke.
_RENDEZVOUS_MARKERS = (
    "RendezvousTimeoutError",
    "RendezvousConnectionError",
    "RendezvousClosedError",
    "DistNetworkError",
    "DistStoreError",
)


# Signals sent to a rank from outside (the OOM killer, an operator, a dying node); a
# rank's own crash (SIGSEGV, SIGABRT, SIGBUS...) stays RankFailedError.
_OUTSIDE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})


def _killed_from_outside(exit_code: int) -> bool:
    return exit_code < 0 and -exit_code in {int(s) for s in _OUTSIDE_SIGNALS}


def _from_record(record: dict[str, Any], spec: LaunchSpec) -> FailureReport:
    """The report of a rank's failure file, read as it is (a failing rank may have written anything)."""
    code = str(record["code"])[:64]
    secondary = bool(record.get("secondary", False))
    if secondary and code == RankFailedError.code:
        # A collective broke under the rank (a peer vanished, the network failed): retryable.
        code = CommunicationError.code
    rank = record.get("rank")
    return FailureReport(
        code=code,
        message=str(record.get("message", ""))[:MAX_FAILURE_MESSAGE],
        rank=rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else None,
        node=str(record.get("node") or spec.node_name)[:200],
        traceback=str(record.get("traceback") or "")[-100_000:] or None,
        secondary=secondary,
    )


def collect_failure(spec: LaunchSpec, exit_code: int | None, torchrun_output: Path) -> FailureReport:
    """The failure to report for ranks that ended badly on this node.

    A rank's own ``failure-rank-<R>.json`` when there is one (the earliest root cause; a
    broken collective is ``CommunicationError``), unless every such file is the echo of a
    rank killed by a signal, which is then the cause (``RankKilledError``). Otherwise it
    is built from torchrun's root cause and the tail of that rank's output:
    ``RankKilledError`` for a rank ended by a signal, ``CommunicationError`` for a
    rendezvous that failed, else ``RankFailedError``.
    """
    record = first_failure(read_failure_files(spec.run_dir))
    cause = root_cause(torchrun_output)
    if cause is None or not _killed_from_outside(cause[2]):
        cause = _killed_rank(torchrun_output) or cause
    killed = cause is not None and _killed_from_outside(cause[2])
    if record is not None and not (killed and record.get("secondary")):
        return _from_record(record, spec)
    rank: int | None = None
    local = 0
    if cause is not None:
        rank, local, code = cause
        message = f"rank {rank} (local rank {local}) on node {spec.node_name} {describe_exit(code)}"
    else:
        code = exit_code if exit_code is not None else -1
        message = f"the ranks on node {spec.node_name} ended: torchrun {describe_exit(code)}"
    tails = []
    for path in sorted(spec.log_dir.glob(f"**/attempt_*/{local}/std*.log")):
        text = tail(path, TRACEBACK_TAIL_LINES)
        if text.strip():
            tails.append(text)
    if not tails:
        tails.append(tail(torchrun_output, TRACEBACK_TAIL_LINES))
    failure_code = RankFailedError.code
    if cause is not None and _killed_from_outside(cause[2]):
        failure_code = RankKilledError.code
    elif any(marker in tail(torchrun_output, 400) for marker in _RENDEZVOUS_MARKERS):
        failure_code = CommunicationError.code
        message += " (the rendezvous or a collective between the ranks failed)"
    return FailureReport(
        code=failure_code, message=message, rank=rank, node=spec.node_name, traceback="\n".join(tails) or None
    )
