"""Starting, watching and stopping one node's share of an attempt: torchrun and its ranks.

torchrun runs in a session of its own (its process group is the unit signals go to);
it starts every rank in yet another session, so the ranks are found instead by a
marker variable in their environment (``TORCHYARD_RUN_MARKER``), read from ``/proc``.
Stopping is SIGTERM to torchrun's group and to every marked process, then SIGKILL to
whatever is left after the grace period; a final sweep kills any marked straggler
(a data loader worker, say), so no process of the run survives it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from torchyard.contract.errors import CommunicationError, RankFailedError, RankKilledError
from torchyard.contract.jobfile import JOB_FILE
from worker.agent import guard, job_tree
from worker.agent.sandbox import Sandbox, exit_code, is_sandbox_process, torch_hub_dir

log = logging.getLogger(__name__)

MARKER_VAR = "TORCHYARD_RUN_MARKER"
TORCHRUN_LOGS = "torchrun-logs"
TRACEBACK_TAIL_LINES = 40
# Inherited variables that would confuse torchrun or its ranks.
_SCRUBBED = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "TORCHELASTIC_RUN_ID",
    "CUDA_VISIBLE_DEVICES",
)
# Secrets of the agent or launcher (and of a service it runs beside) that no rank may see.
_SECRETS = ("TORCHYARD_TOKEN", "TORCHYARD_LAUNCH_TOKEN", "TORCHYARD_DATABASE_URL")


@dataclass(frozen=True)
class LaunchSpec:
    """Where and how this node's ranks start."""

    run_dir: Path
    node_name: str
    node_rank: int
    node_count: int
    nproc: int
    master_addr: str
    master_port: int
    cpus: int
    gpu_ids: tuple[int, ...] = ()  # this placement's GPUs; empty on CPU
    socket_ifname: str | None = None
    extra_env: Mapping[str, str] | None = None
    # The run's sandbox (None: TORCHYARD_SANDBOX=off, or no bwrap on this node).
    box: Sandbox | None = None
    # torchrun and the ranks ignore SIGTERM and SIGUSR1 (worker.agent.guard --shield): an
    # engine that signals every process of its job (Slurm) reaches only the launcher, which
    # asks for a checkpoint; the ranks are stopped with SIGINT instead.
    shielded: bool = False

    @property
    def stop_signal(self) -> signal.Signals:
        return signal.SIGINT if self.shielded else signal.SIGTERM

    @property
    def job_file(self) -> Path:
        return self.run_dir / JOB_FILE

    @property
    def log_dir(self) -> Path:
        return self.run_dir / TORCHRUN_LOGS


def torchrun_command(spec: LaunchSpec) -> list[str]:
    """The per-node launch of the trainer contract."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(spec.node_count),
        "--nproc-per-node",
        str(spec.nproc),
        "--node-rank",
        str(spec.node_rank),
        "--master-addr",
        spec.master_addr,
        "--master-port",
        str(spec.master_port),
        "--log-dir",
        str(spec.log_dir),
        "--redirects",
        "3",
        "-m",
        "worker.trainer",
        "--config",
        str(spec.job_file),
    ]


def visible_devices(gpu_ids: tuple[int, ...], inherited: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a placement's GPUs.

    ``gpu_ids`` index the GPUs this process sees, so when it was itself given a
    ``CUDA_VISIBLE_DEVICES`` (by Slurm, or an admin restricting the agent) they are positions
    in that list, never physical indexes: a 1-GPU Slurm job given GPU 1 keeps GPU 1.
    """
    if inherited is None or not inherited.strip():
        return ",".join(str(i) for i in gpu_ids)
    visible = [d.strip() for d in inherited.split(",") if d.strip()]
    return ",".join(visible[i] if i < len(visible) else str(i) for i in gpu_ids)


def rank_env(spec: LaunchSpec, base: Mapping[str, str], marker: str) -> dict[str, str]:
    """torchrun's environment: it passes it on to every rank. Never the worker token."""
    inherited = base.get("CUDA_VISIBLE_DEVICES")
    env = {k: v for k, v in base.items() if k not in _SCRUBBED and k not in _SECRETS}
    env[MARKER_VAR] = marker
    env["TORCHYARD_NODE_NAME"] = spec.node_name
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = str(max(1, spec.cpus // spec.nproc))
    if spec.gpu_ids:
        # One GPU per local rank: LOCAL_RANK indexes this placement's GPUs.
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(spec.gpu_ids, inherited)
        env["TORCHYARD_DEVICE"] = "cuda"
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        if spec.socket_ifname:
            env.setdefault("NCCL_SOCKET_IFNAME", spec.socket_ifname)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["TORCHYARD_DEVICE"] = "cpu"
    if spec.socket_ifname:
        # gloo (CPU collectives, and NCCL's bootstrap store) binds where peers can reach it.
        env.setdefault("GLOO_SOCKET_IFNAME", spec.socket_ifname)
    if spec.box is not None:
        # The agent's home is not in the sandbox: /tmp is the run's own; the offline torch
        # hub (pretrained weights) is shown read-only where torch looks for it.
        env["TORCH_HOME"] = str(torch_hub_dir(base).parent)
        env["HOME"] = "/tmp"
    if spec.shielded:
        # torchrun keeps the SIGTERM it inherited ignored (its default handler stops the
        # ranks): its --signals-to-handle option (PET_ variable) and what older versions read.
        handled = "SIGINT,SIGHUP,SIGQUIT"
        env["PET_SIGNALS_TO_HANDLE"] = env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = handled
    if spec.extra_env:
        env.update(spec.extra_env)
    return env


# --- the process table ------------------------------------------------------------------------


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


def _signal_pids(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:  # pragma: no cover - the pid was reused by someone else
            pass


class RankGroup:
    """torchrun and its ranks for one placement on this node."""

    def __init__(self, spec: LaunchSpec, *, env: Mapping[str, str] | None = None) -> None:
        self.spec = spec
        # run_dir is <work dir>/runs/<run>: the agent's work directory scopes the marker.
        self.marker = marker_scope(spec.node_name, spec.run_dir.parent.parent) + secrets.token_hex(8)
        self.env = rank_env(spec, os.environ if env is None else env, self.marker)
        self.command = torchrun_command(spec)
        self.process: subprocess.Popen[bytes] | None = None
        self.stopped = False

    def start(self, output: TextIO) -> int:
        """Start torchrun (its own output goes to ``output``, the launcher log); returns its pid."""
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        command = self.command
        if self.spec.box is not None:
            self.spec.box.give_writable()
            command = self.spec.box.command(command, self.spec.run_dir)
        shield = [guard.SHIELD] if self.spec.shielded else []
        # -I: the guard runs outside the sandbox, in the run's folder, which must not be
        # where its modules come from.
        guarded = [sys.executable, "-I", guard.__file__, *shield, str(os.getpid()), *command]
        self.process = subprocess.Popen(
            guarded,
            cwd=self.spec.run_dir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self.process.pid

    def _code(self, code: int | None) -> int | None:
        return exit_code(code) if self.spec.box is not None else code

    def poll(self) -> int | None:
        assert self.process is not None
        return self._code(self.process.poll())

    def wait(self, timeout: float | None = None) -> int | None:
        assert self.process is not None
        try:
            return self._code(self.process.wait(timeout))
        except subprocess.TimeoutExpired:
            return None

    def alive_pids(self) -> list[int]:
        return marked_pids(self.marker)

    def _signal_all(self, sig: signal.Signals) -> None:
        if self.spec.box is not None and sig != signal.SIGKILL:
            # bwrap ends the whole sandbox at once on SIGTERM: torchrun and the ranks get the
            # signal (and the grace period); SIGKILL of the sandbox ends whatever is left.
            _signal_pids([p for p in self.alive_pids() if not is_sandbox_process(p)], sig)
            return
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
        _signal_pids(self.alive_pids(), sig)

    def stop(self, grace: float) -> int | None:
        """SIGTERM (SIGINT when shielded) everything, SIGKILL what is left after ``grace``
        seconds; torchrun's exit code."""
        self.stopped = True
        self._signal_all(self.spec.stop_signal)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if (self.process is None or self.process.poll() is not None) and not self.alive_pids():
                break
            time.sleep(0.1)
        else:
            log.warning(
                "ranks still alive %.0f s after %s: sending SIGKILL", grace, self.spec.stop_signal.name
            )
            self._signal_all(signal.SIGKILL)
        code = self.wait(10) if self.process is not None else None
        self.sweep()
        return code

    def sweep(self, timeout: float = 5.0) -> list[int]:
        """Kill any process of this run still alive (after torchrun itself has ended)."""
        left = self.alive_pids()
        if not left:
            return []
        log.warning("killing %d leftover process(es) of the run: %s", len(left), left)
        _signal_pids(left, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while self.alive_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        return left


# --- logs and failures ------------------------------------------------------------------------


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


def _tail(path: Path, lines: int) -> str:
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


def _root_cause(launcher_log: Path) -> tuple[int, int, int] | None:
    """torchrun's "Root Cause (first observed failure)": global rank, local rank, exit code."""
    matches = list(_ROOT_CAUSE.finditer(_tail(launcher_log, 400)))
    if not matches:
        return None
    last = matches[-1]
    return int(last.group(1)), int(last.group(2)), int(last.group(3))


_FAILURE_ENTRY = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*exitcode\s*:\s*(-?\d+)")


def _killed_rank(launcher_log: Path) -> tuple[int, int, int] | None:
    """A rank of torchrun's failure report (its "Failures" or its root cause) killed by
    a signal from outside. torchrun names as root cause the failure it dates first, to
    the second: a peer whose collective broke under the killed rank may come first."""
    for match in _FAILURE_ENTRY.finditer(_tail(launcher_log, 400)):
        entry = int(match.group(1)), int(match.group(2)), int(match.group(3))
        if _killed_from_outside(entry[2]):
            return entry
    return None


def _describe_exit(code: int) -> str:
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


def _from_record(record: dict[str, Any], spec: LaunchSpec) -> dict[str, Any]:
    code = str(record["code"])[:64]
    secondary = bool(record.get("secondary", False))
    if secondary and code == RankFailedError.code:
        # A collective broke under the rank (a peer vanished, the network failed): retryable.
        code = CommunicationError.code
    return {
        "code": code,
        "message": str(record.get("message", ""))[:20_000],
        "rank": record.get("rank") if isinstance(record.get("rank"), int) else None,
        "node": str(record.get("node") or spec.node_name)[:200],
        "traceback": str(record.get("traceback") or "")[-100_000:] or None,
        "secondary": secondary,
    }


def collect_failure(spec: LaunchSpec, exit_code: int | None, launcher_log: Path) -> dict[str, Any]:
    """The failure to report for ranks that ended badly on this node.

    A rank's own ``failure-rank-<R>.json`` when there is one (the earliest root cause; a
    broken collective is ``CommunicationError``), unless every such file is the echo of a
    rank killed by a signal, which is then the cause (``RankKilledError``). Otherwise it
    is built from torchrun's root cause and the tail of that rank's output:
    ``RankKilledError`` for a rank ended by a signal, ``CommunicationError`` for a
    rendezvous that failed, else ``RankFailedError``.
    """
    record = first_failure(read_failure_files(spec.run_dir))
    cause = _root_cause(launcher_log)
    if cause is None or not _killed_from_outside(cause[2]):
        cause = _killed_rank(launcher_log) or cause
    killed = cause is not None and _killed_from_outside(cause[2])
    if record is not None and not (killed and record.get("secondary")):
        return _from_record(record, spec)
    rank: int | None = None
    local = 0
    if cause is not None:
        rank, local, code = cause
        message = f"rank {rank} (local rank {local}) on node {spec.node_name} {_describe_exit(code)}"
    else:
        code = exit_code if exit_code is not None else -1
        message = f"the ranks on node {spec.node_name} ended: torchrun {_describe_exit(code)}"
    tails = []
    for path in sorted(spec.log_dir.glob(f"**/attempt_*/{local}/std*.log")):
        text = _tail(path, TRACEBACK_TAIL_LINES)
        if text.strip():
            tails.append(text)
    if not tails:
        tails.append(_tail(launcher_log, TRACEBACK_TAIL_LINES))
    failure_code = RankFailedError.code
    if cause is not None and _killed_from_outside(cause[2]):
        failure_code = RankKilledError.code
    elif any(marker in _tail(launcher_log, 400) for marker in _RENDEZVOUS_MARKERS):
        failure_code = CommunicationError.code
        message += " (the rendezvous or a collective between the ranks failed)"
    return {
        "code": failure_code,
        "message": message,
        "rank": rank,
        "node": spec.node_name,
        "traceback": "\n".join(tails) or None,
        "secondary": False,
    }


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
        _signal_pids(pids, signal.SIGKILL)
    return pids
