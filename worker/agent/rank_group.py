"""Starting, watching and stopping one node's share of an attempt: torchrun and its ranks.

torchrun runs in a session of its own (its process group is the unit signals go to);
it starts every rank in yet another session, so the ranks are found instead by a
marker variable in their environment (``TORCHYARD_RUN_MARKER``), read from ``/proc``.
Stopping is SIGTERM to torchrun's group and to every marked process, then SIGKILL to
whatever is left after the grace period; a last pass kills any marked straggler
(a data loader worker, say), so no process of the run survives it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from torchyard.contract.jobfile import JOB_FILE, TRAINER_HOOKS_VARIABLE
from worker.agent import guard
from worker.agent.job_env import DIST_VARS, SECRET_VARS
from worker.agent.marked_processes import MARKER_VAR, kill_marked, marked_pids, marker_scope, signal_pids
from worker.agent.sandbox import Sandbox, exit_code, is_sandbox_process, torch_hub_dir

log = logging.getLogger(__name__)

TORCHRUN_LOGS = "torchrun-logs"


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


def trainer_hook_files(env: Mapping[str, str]) -> list[Path]:
    """The trainer's hooks modules that ``TORCHYARD_TRAINER_HOOKS`` names by a file's absolute path."""
    names = (name.strip() for name in env.get(TRAINER_HOOKS_VARIABLE, "").split(","))
    return [Path(name) for name in names if os.path.isabs(name)]


def rank_env(spec: LaunchSpec, base: Mapping[str, str], marker: str) -> dict[str, str]:
    """torchrun's environment: it passes it on to every rank. Never the worker token."""
    inherited = base.get("CUDA_VISIBLE_DEVICES")
    env = {k: v for k, v in base.items() if k not in DIST_VARS and k not in SECRET_VARS}
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
        """Start torchrun (its own output goes to ``output``, the placement's log); returns its pid."""
        self.spec.log_dir.mkdir(parents=True, exist_ok=True)
        command = self.command
        box = self.spec.box
        if box is not None:
            box.give_writable()
            # The node's trainer hooks (files) are shown to the ranks, read-only.
            box = dataclasses.replace(box, read_only=[*box.read_only, *trainer_hook_files(self.env)])
            command = box.command(command, self.spec.run_dir)
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
            signal_pids([p for p in self.alive_pids() if not is_sandbox_process(p)], sig)
            return
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
        signal_pids(self.alive_pids(), sig)

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
        self.kill_stragglers()
        return code

    def kill_stragglers(self, timeout: float = 5.0) -> list[int]:
        """Kill any process of this run still alive (after torchrun itself has ended)."""
        return kill_marked(self.marker, "the run", timeout)
