"""A script job's share of one node (docs/script-jobs.md): its processes, started, watched and
stopped, their MLflow endpoint and TensorBoard reader, and what they wrote.

How each process starts (its command, variables and environment) is
:mod:`worker.agent.script_launch`; the inputs are :mod:`worker.agent.script_inputs`, the
outputs archive :mod:`worker.agent.script_outputs`.

The run's folder (``run_dir``) is the one its processes may write; everything the agent
writes itself (the processes' stdout, the MLflow endpoint's and the TensorBoard reader's
metric files, ``tracking.json``, the outputs archive) goes to ``agent_dir``, out of their
reach, and what the agent reads of ``run_dir`` it reads through :mod:`worker.agent.job_tree`.

Each process is the leader of a session of its own; stopping signals every session and
every process carrying the run's marker variable, so children a script started go too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import TextIO

from torchyard.contract.errors import RankFailedError, RankKilledError
from torchyard.contract.failures import FailureReport
from torchyard.contract.reports import log_file_stream
from worker.agent import guard, job_tree, net_relay, sandbox
from worker.agent.marked_processes import kill_marked, marked_pids, marker_scope, signal_pids
from worker.agent.mlflow_endpoint.server import TrackingEndpoint
from worker.agent.mlflow_endpoint.store import tracking_snapshot
from worker.agent.net_bridge import SOCKET_IN_SANDBOX, Bridge
from worker.agent.rank_failures import TRACEBACK_TAIL_LINES, describe_exit, root_cause, tail
from worker.agent.rank_group import visible_devices
from worker.agent.script_launch import ScriptLaunch, ScriptProcess, command_argv, script_env
from worker.agent.script_sys_metrics import SampledProcess, ScriptSystemSampler
from worker.agent.tensorboard_scalars import ScalarTailer, mlflow_artifacts
from worker.agent.unkept_files import name_unkept_files
from worker.system_probe import GpuProbe, sampling_interval

log = logging.getLogger(__name__)

# The files of a node's ./logs folder shipped as log streams (``file-<node rank>/<path>``):
# at most this many, text only (a file whose first bytes hold a NUL is left out), and each
# up to the reader's per-file bound (``run_files.MAX_LOG_FILE_BYTES``).
MAX_LOG_DIR_FILES = 32
_TEXT_SNIFF_BYTES = 8192


class ScriptGroup:
    """The script processes of one placement on this node, and their MLflow endpoint.

    ``job_log`` is the placement's own logger (its lines are the job's ``agent-<node>``
    stream): what is left out of the job's files is said there."""

    def __init__(
        self,
        launch: ScriptLaunch,
        *,
        env: Mapping[str, str] | None = None,
        job_log: logging.Logger | None = None,
    ) -> None:
        self.launch = launch
        self.job_log = job_log or log
        self.marker = marker_scope(launch.node_name, launch.run_dir.parent.parent) + secrets.token_hex(8)
        base = os.environ if env is None else env
        locals_: list[int | None] = list(range(launch.nproc)) if launch.launch == "per_process" else [None]
        self.tracking, self.bridge = self._start_tracking()
        self.processes = [self._process(local, base) for local in locals_]
        self.command = self.processes[0].argv
        first = launch.node_rank * launch.nproc
        roots = [(p.cwd, p.rank, False) for p in self.processes]
        roots += [(launch.outputs_dir, first, True), (launch.logs_dir, first, True)]
        # Files mlflow.log_artifact(s) copied to the endpoint's artifact folders are not read.
        skip = mlflow_artifacts(launch.outputs_dir) if self.tracking is not None else None
        self.scalars = ScalarTailer(roots, launch.agent_metrics_dir, self.job_log, skip=skip)
        self.failed: ScriptProcess | None = None
        self.sys_interval = self._sys_interval(base)
        self._inherited_gpus = base.get("CUDA_VISIBLE_DEVICES")
        self.sampler: ScriptSystemSampler | None = None
        # ./logs files already judged: their stream name, or None when left out.
        self._log_dir_files: dict[Path, str | None] = {}
        self._log_dir_full = False
        self.stopped = False

    def _sys_interval(self, base: Mapping[str, str]) -> float:
        """The agent's ``TORCHYARD_SYS_METRICS_INTERVAL_S`` (0: no system metrics)."""
        try:
            return sampling_interval(base)
        except ValueError as exc:
            self.job_log.warning("no system metrics: %s", exc)
            return 0.0

    def _start_tracking(self) -> tuple[TrackingEndpoint | None, Bridge | None]:
        """The placement's MLflow endpoint (none where the job names its own server) and, for a
        run without network, the bridge its processes reach it through."""
        launch = self.launch
        if "MLFLOW_TRACKING_URI" in launch.variables:
            return None, None
        tracking = TrackingEndpoint(launch.agent_dir, launch.outputs_dir, launch.node_rank)
        tracking.start()
        bridge = None
        if launch.network == "none" and launch.box is not None:
            launch.agent_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            bridge = Bridge(launch.agent_dir / "mlflow.sock", tracking, launch.box.user)
            bridge.start()
        return tracking, bridge

    def _process(self, local: int | None, base: Mapping[str, str]) -> ScriptProcess:
        """One process of the placement (``local`` None: the node's one command, per node)."""
        launch = self.launch
        rank = launch.node_rank * launch.nproc + (local or 0)
        name = f"rank-{rank}" if local is not None else f"node-{launch.node_rank}"
        process_env = script_env(launch, base, self.marker, local, rank)
        if self.tracking is not None:
            process_env.update(self.tracking.env_for(rank, name, ranks_from_caller=local is None))
        return ScriptProcess(
            rank=rank,
            local_rank=local,
            argv=command_argv(launch, process_env, local),
            env=process_env,
            cwd=launch.run_dir / "work" / name,
            log_path=launch.stdout_dir / f"{name}.log",
            metrics_path=Path(process_env["TORCHYARD_METRICS_FILE"]),
        )

    # --- start --------------------------------------------------------------------------

    def _prepare(self) -> None:
        launch = self.launch
        for folder in (launch.outputs_dir, launch.logs_dir, launch.metrics_dir):
            folder.mkdir(parents=True, exist_ok=True)
        launch.agent_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for folder in (launch.stdout_dir, launch.agent_metrics_dir):
            folder.mkdir(exist_ok=True)
        for proc in self.processes:
            if proc.cwd.exists():
                shutil.rmtree(proc.cwd)
            if launch.code_dir is not None:
                shutil.copytree(launch.code_dir, proc.cwd, symlinks=False)
            else:
                proc.cwd.mkdir(parents=True)
            for link, target in (("outputs", launch.outputs_dir), ("logs", launch.logs_dir)):
                if not (proc.cwd / link).exists():
                    (proc.cwd / link).symlink_to(target, target_is_directory=True)

    def _run_box(self) -> sandbox.Sandbox | None:
        """The sandbox every process of this placement on the node runs in (None: unconfined)."""
        box = self.launch.box
        if box is None:
            return None
        shm = None
        if len(self.processes) > 1:
            # Processes of one run on one node share memory (torch's and NCCL's /dev/shm).
            shm = self.shared_shm
            shm.mkdir(mode=0o700, exist_ok=True)
        run_box = dataclasses.replace(box, gpus=bool(self.launch.gpu_ids), shared_shm=shm)
        if self.launch.network == "none":
            run_box = dataclasses.replace(run_box, network=False)
            if self.bridge is not None:
                # The endpoint's port on the run's own loopback, relayed to the bridge.
                run_box = dataclasses.replace(run_box, binds=[(self.bridge.path, SOCKET_IN_SANDBOX)])
        return run_box

    def _sandboxed(self, proc: ScriptProcess, run_box: sandbox.Sandbox | None) -> list[str]:
        if run_box is None:
            return proc.argv
        argv = proc.argv
        if run_box.binds and self.tracking is not None:
            relay = [sys.executable, "-I", net_relay.__file__, SOCKET_IN_SANDBOX]
            argv = [*relay, str(self.tracking.address[1]), "--", *argv]
        return run_box.command(argv, proc.cwd)

    @property
    def shared_shm(self) -> Path:
        folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else self.launch.run_dir
        return folder / f"torchyard-{hashlib.sha256(self.marker.encode()).hexdigest()[:16]}"

    def start(self, output: TextIO) -> int:
        """Copy the code, start every process; the first one's pid."""
        self._prepare()
        run_box = self._run_box()
        if run_box is not None:
            run_box.give_writable()  # once: the run's folder is every process's
        for proc in self.processes:
            print(f"rank {proc.rank}: {shlex.join(proc.argv)} (in {proc.cwd})", file=output, flush=True)
            with open(proc.log_path, "ab") as out:
                proc.process = subprocess.Popen(
                    [sys.executable, "-I", guard.__file__, str(os.getpid()), *self._sandboxed(proc, run_box)],
                    cwd=proc.cwd,
                    env=proc.env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        self.scalars.start()
        first = self.processes[0].process
        assert first is not None
        return first.pid

    def start_sampling(self, latest_step: Callable[[int], int | None] | None = None) -> None:
        """Sample every process's CPU, memory and GPU each interval into the agent's metrics
        folder (:mod:`worker.agent.script_sys_metrics`); nothing when the interval is 0.
        ``latest_step(rank)``: the latest step the script logged for that rank."""
        if self.sys_interval <= 0 or self.sampler is not None:
            return
        processes = [SampledProcess(p.rank, self._live_pid(p), self._gpu_probe(p)) for p in self.processes]
        self.sampler = ScriptSystemSampler(
            processes, self.launch.agent_metrics_dir, self.sys_interval, latest_step=latest_step
        )
        self.sampler.start()

    @staticmethod
    def _live_pid(proc: ScriptProcess) -> Callable[[], int | None]:
        def pid() -> int | None:
            running = proc.process is not None and proc.process.returncode is None
            return proc.process.pid if running and proc.process is not None else None

        return pid

    def _gpu_probe(self, proc: ScriptProcess) -> GpuProbe | None:
        """The GPU at the process's local rank among the placement's (per node: the only one)."""
        gpus = self.launch.gpu_ids
        local = proc.local_rank if proc.local_rank is not None else (0 if len(gpus) == 1 else None)
        if local is None or local >= len(gpus):
            return None
        return GpuProbe.named(visible_devices((gpus[local],), self._inherited_gpus))

    def stop_sampling(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None

    # --- watch --------------------------------------------------------------------------

    def _poll(self) -> int | None:
        """0 once every process exited 0; the exit code of the first that failed; None while running."""
        running = False
        for proc in self.processes:
            code = self._returncode(proc)
            if code is None:
                running = True
            elif code != 0:
                self.failed = self.failed or proc
                return code
        return None if running else 0

    def wait(self, timeout: float | None = None) -> int | None:
        deadline = time.monotonic() + (timeout or 0.0)
        while True:
            code = self._poll()
            if code is not None:
                if code != 0:
                    # One rank failed: the others on this node are stopped, not left hanging.
                    self.stop(self.launch.grace_s)
                return code
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _returncode(self, proc: ScriptProcess) -> int | None:
        code = proc.process.poll() if proc.process is not None else None
        return sandbox.exit_code(code) if self.launch.box is not None else code

    def alive_pids(self) -> list[int]:
        return marked_pids(self.marker)

    def _signal_all(self, sig: signal.Signals) -> None:
        pids = self.alive_pids()
        if self.launch.box is not None and sig != signal.SIGKILL:
            # bwrap ends the whole sandbox at once on SIGTERM: the script's own processes get
            # the signal (and the grace period); SIGKILL of the sandbox ends whatever is left.
            signal_pids([p for p in pids if not sandbox.is_sandbox_process(p)], sig)
            return
        for proc in self.processes:
            if proc.process is not None and proc.process.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.process.pid, sig)
        signal_pids(pids, sig)

    def _all_ended(self) -> bool:
        return all(p.process is None or p.process.poll() is not None for p in self.processes)

    def stop(self, grace: float) -> int | None:
        """SIGTERM every session and marked process, SIGKILL after ``grace``; the first failure's code."""
        self.stopped = True
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self._all_ended() and not self.alive_pids():
                break
            time.sleep(0.1)
        else:
            log.warning("script processes still alive %.0f s after SIGTERM: sending SIGKILL", grace)
            self._signal_all(signal.SIGKILL)
        for proc in self.processes:
            if proc.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.process.wait(10)
        self.kill_stragglers()
        codes = [self._returncode(p) for p in self.processes if p.process is not None]
        return next((c for c in codes if c), codes[0] if codes else None)

    def kill_stragglers(self, timeout: float = 5.0) -> list[int]:
        """Kill whatever the run left behind (a script's own children)."""
        for proc in self.processes:
            if proc.process is not None and proc.process.poll() is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.process.pid, signal.SIGKILL)
        if self.launch.box is not None:
            shutil.rmtree(self.shared_shm, ignore_errors=True)
        return kill_marked(self.marker, "the script", timeout)

    # --- what it wrote ------------------------------------------------------------------

    def log_files(self) -> list[tuple[str, Path]]:
        """Each process's stdout/stderr (``rank-<rank>``) and the text files under the node's
        ``./logs`` (``file-<node rank>/<path>``)."""
        own = [(f"rank-{p.rank}", p.log_path) for p in self.processes]
        return own + self.log_dir_files()

    def log_dir_files(self) -> list[tuple[str, Path]]:
        """The node's ``./logs`` files shipped as streams: regular, non-empty text files whose
        path makes a stream name, up to ``MAX_LOG_DIR_FILES``; each judged once."""
        folder = self.launch.logs_dir
        for root, dirs, names in os.walk(folder, followlinks=False):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(names):
                path = Path(root) / name
                if path in self._log_dir_files:
                    continue
                judged = self._judge_log_file(folder, path)
                if judged == "":
                    continue  # empty so far: looked at again next time
                self._log_dir_files[path] = judged
        return [(stream, path) for path, stream in self._log_dir_files.items() if stream is not None]

    def _judge_log_file(self, folder: Path, path: Path) -> str | None:
        """The file's stream name; None when it is left out; "" while it is still empty."""
        relative = path.relative_to(folder).as_posix()
        shipped = sum(1 for s in self._log_dir_files.values() if s is not None)
        if shipped >= MAX_LOG_DIR_FILES:
            if not self._log_dir_full:
                self._log_dir_full = True
                self.job_log.warning(
                    "logs: more than %d files under ./logs: the others are not shipped as log streams "
                    "(the outputs archive holds them under logs/)",
                    MAX_LOG_DIR_FILES,
                )
            return None
        try:
            with job_tree.open_regular(folder, relative) as fh:
                head = fh.read(_TEXT_SNIFF_BYTES)
        except job_tree.NotRegularFileError:
            self.job_log.warning("logs: %s is not a log stream (not a regular file)", relative)
            return None
        except OSError:
            return ""
        if not head:
            return ""
        stream = log_file_stream(self.launch.node_rank, relative)
        if stream is None:
            self.job_log.warning(
                "logs: %s is not a log stream (a path of letters, digits and ._- is; the outputs archive "
                "holds it under logs/)",
                relative,
            )
            return None
        if b"\x00" in head:
            self.job_log.warning(
                "logs: %s is not a log stream (not a text file; the outputs archive holds it under logs/)",
                relative,
            )
            return None
        return stream

    def metric_files(self) -> list[Path]:
        """The processes' metric files (``metrics/*.jsonl`` of the run's folder, read through
        job_tree), then the agent's own (MLflow points, TensorBoard scalars, CSV points)."""
        own = sorted(self.launch.metrics_dir.glob("*.jsonl"))
        return own + sorted(self.launch.agent_metrics_dir.glob("*.jsonl"))

    def tracking_source(self) -> bytes | None:
        """The MLflow runs of this placement as the endpoint last wrote them."""
        return tracking_snapshot(self.launch.agent_dir)()

    def close_tracking(self) -> None:
        """Stop the MLflow endpoint and read the TensorBoard files a last time (every process
        has ended)."""
        self.stop_sampling()
        self.scalars.stop()
        if self.bridge is not None:
            self.bridge.stop()
            self.bridge = None
        if self.tracking is not None:
            self.tracking.stop()
            self.tracking = None

    def working_copies(self) -> list[Path]:
        return list(dict.fromkeys(p.cwd for p in self.processes))

    def name_unkept_files(self, kept: Collection[str] = ()) -> list[str]:
        """Say in the job's log which files the processes wrote in their working copies (see
        :func:`~worker.agent.unkept_files.name_unkept_files`); the files as ``<copy>/<path>``."""
        return name_unkept_files(self.working_copies(), self.launch.code_dir, kept, self.job_log)

    def failure(self, exit_code: int | None) -> FailureReport:
        """``RankFailedError`` (``RankKilledError`` for a signal) naming the rank, the node and its log tail."""
        proc = self.failed or self.processes[0]
        code = exit_code if exit_code is not None else -1
        rank: int | None = proc.rank if proc.local_rank is not None else None
        if proc.local_rank is None:
            cause = root_cause(proc.log_path)  # the command was torchrun: its own report
            if cause is not None:
                rank, _local, code = cause
        who = f"rank {rank}" if rank is not None else "the command"
        return FailureReport(
            code=RankKilledError.code if code < 0 else RankFailedError.code,
            message=f"{who} on node {self.launch.node_name} {describe_exit(code)}",
            rank=rank,
            node=self.launch.node_name,
            traceback=tail(proc.log_path, TRACEBACK_TAIL_LINES) or None,
        )
