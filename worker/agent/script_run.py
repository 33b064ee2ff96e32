"""A script job's share of one node (docs/script-jobs.md): its inputs, environment and processes.

Every process runs the job's ``command`` (no shell; ``$NAME``/``${NAME}`` expanded from
the launch variables and the ``TORCHYARD_*`` paths below only) in a fresh copy of the code, with the variables of docs/script-jobs.md:
``per_process`` starts ``process_count_per_node`` processes each with ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``; ``per_node`` starts one with ``NNODES``, ``NPROC_PER_NODE``,
``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, so the command may be ``torchrun``.

The run's folder (``run_dir``) is the one its processes may write; everything the agent
writes itself (the processes' stdout, the MLflow endpoint's and the TensorBoard reader's
metric files, ``tracking.json``, the outputs archive) goes to ``agent_dir``, out of their
reach, and what the agent reads of ``run_dir`` it reads through :mod:`worker.agent.job_tree`.

A process's environment is the agent's minus its secrets and every ``TORCHYARD_*``
variable of its own, plus the job's ``environment.variables`` and the paths below, all
inside this placement's run directory: ``TORCHYARD_OUTPUT_DIR`` and ``TORCHYARD_LOG_DIR``
(shared by the node's processes; ``./outputs`` and ``./logs`` in each copy point there),
``TORCHYARD_METRICS_FILE`` and ``TORCHYARD_INPUT_<NAME>`` (a hard-linked copy of the
dataset from the node's cache). Each process is the leader of a session of its own;
stopping signals every session and every process carrying the run's marker variable,
so children a script started go too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from torchyard.contract.archive import MAX_OUTPUTS_FILES, MAX_OUTPUTS_UNCOMPRESSED_BYTES
from torchyard.contract.deflate import GzipWriter, LevelChooser
from torchyard.contract.errors import SandboxUnavailableError
from torchyard.contract.files import sha256_file
from torchyard.contract.jobspec import input_variable
from torchyard.contract.reports import log_file_stream
from worker.agent import guard, job_tree, net_relay, sandbox
from worker.agent.api import retrying
from worker.agent.launcher import (
    _SCRUBBED,
    _SECRETS,
    MARKER_VAR,
    TRACEBACK_TAIL_LINES,
    _describe_exit,
    _root_cause,
    _signal_pids,
    _tail,
    marked_pids,
    marker_scope,
    visible_devices,
)
from worker.agent.mlflow_endpoint import TrackingEndpoint, tracking_snapshot
from worker.agent.net_bridge import SOCKET_IN_SANDBOX, Bridge
from worker.agent.retry import Deadline
from worker.agent.tensorboard_scalars import ScalarTailer, mlflow_artifacts

if TYPE_CHECKING:
    from torchyard.contract.protocol import ScriptPlacement
    from worker.agent.context import AgentContext
    from worker.agent.lease import LeaseSession

log = logging.getLogger(__name__)

FETCH_DEADLINE_S = 600
_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*)|(\$))")
_PYTHON_NAMES = re.compile(r"^python(3(\.\d+)?)?$")
# The files of a node's ./logs folder shipped as log streams (``file-<node rank>/<path>``):
# at most this many, text only (a file whose first bytes hold a NUL is left out), and each
# up to the reader's per-file bound (``run_files.MAX_LOG_FILE_BYTES``).
MAX_LOG_DIR_FILES = 32
_TEXT_SNIFF_BYTES = 8192
# What of a node's ./logs goes into the outputs archive (under ``logs/``): at most this many
# files and bytes in all, each file up to MAX_ARCHIVED_LOG_FILE_BYTES; the rest is named in
# the job's log.
MAX_ARCHIVED_LOG_FILES = 1000
MAX_ARCHIVED_LOG_BYTES = 512 << 20
MAX_ARCHIVED_LOG_FILE_BYTES = 256 << 20
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
# Lightning's default root folder (``default_root_dir``: the working directory) for its
# loggers and checkpoints: a working copy's is kept in the outputs archive under
# ``lightning_logs/``, at most this many files and bytes (the rest named in the job's log).
LIGHTNING_LOGS = "lightning_logs"
MAX_ARCHIVED_LIGHTNING_FILES = 1000
MAX_ARCHIVED_LIGHTNING_BYTES = 2 << 30


def expand(arg: str, variables: Mapping[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` replaced from ``variables`` (others left as written), ``$$`` → ``$``."""

    def sub(match: re.Match[str]) -> str:
        if match.group(3):
            return "$"
        name = match.group(1) or match.group(2)
        return variables.get(name, match.group(0))

    return _VARIABLE.sub(sub, arg)


@dataclass(frozen=True)
class ScriptLaunch:
    """Where and how this node's script processes start."""

    run_dir: Path
    node_name: str
    node_rank: int
    node_count: int
    nproc: int
    master_addr: str
    master_port: int
    cpus: int
    command: tuple[str, ...]
    launch: str = "per_process"
    variables: Mapping[str, str] = field(default_factory=dict)
    inputs: Mapping[str, Path] = field(default_factory=dict)
    code_dir: Path | None = None
    env_dir: Path | None = None
    gpu_ids: tuple[int, ...] = ()
    socket_ifname: str | None = None
    grace_s: float = 10.0
    # The run's sandbox (None: TORCHYARD_SANDBOX=off, the processes run as the agent does).
    box: sandbox.Sandbox | None = None
    # The agent's own folder of the placement (never shown to the processes); by default
    # beside the run's folder.
    own_dir: Path | None = None
    # environment.network: host, or none (a network of the run's own, its MLflow endpoint
    # reached through a socket of the agent's: worker.agent.net_bridge).
    network: str = "host"

    @property
    def agent_dir(self) -> Path:
        return (
            self.own_dir if self.own_dir is not None else self.run_dir.with_name(f"{self.run_dir.name}.agent")
        )

    @property
    def outputs_dir(self) -> Path:
        return self.run_dir / "outputs"

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / "logs"

    @property
    def metrics_dir(self) -> Path:
        return self.run_dir / "metrics"

    @property
    def stdout_dir(self) -> Path:
        return self.agent_dir / "stdout"

    @property
    def agent_metrics_dir(self) -> Path:
        """The metric files the agent writes (MLflow points, TensorBoard scalars, CSV points)."""
        return self.agent_dir / "metrics"

    @property
    def python(self) -> str:
        return str(self.env_dir / "bin" / "python") if self.env_dir is not None else sys.executable

    def launch_variables(self, local_rank: int | None) -> dict[str, str]:
        """The variables of docs/script-jobs.md for one process (``local_rank`` None: per node)."""
        common = {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "NODE_RANK": str(self.node_rank),
        }
        if local_rank is None:
            return {**common, "NNODES": str(self.node_count), "NPROC_PER_NODE": str(self.nproc)}
        return {
            **common,
            "WORLD_SIZE": str(self.node_count * self.nproc),
            "RANK": str(self.node_rank * self.nproc + local_rank),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(self.nproc),
        }


@dataclass
class ScriptProcess:
    rank: int  # the global rank (per node: the node's first rank, whose log stream it feeds)
    local_rank: int | None
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    log_path: Path
    metrics_path: Path
    process: subprocess.Popen[bytes] | None = None


def script_env(
    launch: ScriptLaunch, base: Mapping[str, str], marker: str, local_rank: int | None, rank: int
) -> dict[str, str]:
    """One process's environment: never the worker's token nor the agent's own settings."""
    inherited = base.get("CUDA_VISIBLE_DEVICES")
    env = {
        k: v
        for k, v in base.items()
        if k not in _SCRUBBED and k not in _SECRETS and not k.startswith("TORCHYARD_") and k != "VIRTUAL_ENV"
    }
    env.update(launch.variables)
    bins = [str(Path(launch.python).parent), str(Path(sys.executable).parent)]
    env["PATH"] = os.pathsep.join([*dict.fromkeys(bins), env.get("PATH", os.defpath)])
    if launch.env_dir is not None:
        env["VIRTUAL_ENV"] = str(launch.env_dir)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", str(max(1, launch.cpus // launch.nproc)))
    if launch.gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(launch.gpu_ids, inherited)
        if launch.socket_ifname:
            env.setdefault("NCCL_SOCKET_IFNAME", launch.socket_ifname)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if launch.socket_ifname:
        env.setdefault("GLOO_SOCKET_IFNAME", launch.socket_ifname)
    env.update(launch.launch_variables(local_rank))
    env[MARKER_VAR] = marker
    if launch.box is not None:
        env["HOME"] = "/tmp"  # the agent's home is not in the sandbox; /tmp is the run's own
    env["TORCHYARD_OUTPUT_DIR"] = str(launch.outputs_dir)
    env["TORCHYARD_LOG_DIR"] = str(launch.logs_dir)
    name = f"rank-{rank}" if local_rank is not None else f"node-{launch.node_rank}"
    env["TORCHYARD_METRICS_FILE"] = str(launch.metrics_dir / f"{name}.jsonl")
    for input_name, path in launch.inputs.items():
        env[input_variable(input_name)] = str(path)
    return env


def command_variables(
    launch: ScriptLaunch, process_env: Mapping[str, str], local_rank: int | None
) -> dict[str, str]:
    """What ``$NAME`` in the command may name: the launch variables of docs/script-jobs.md and the
    ``TORCHYARD_*`` paths the agent gives the process, nothing else of its environment."""
    paths = ["TORCHYARD_OUTPUT_DIR", "TORCHYARD_LOG_DIR", "TORCHYARD_METRICS_FILE"]
    paths += [input_variable(name) for name in launch.inputs]
    return {**launch.launch_variables(local_rank), **{k: process_env[k] for k in paths}}


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
        self.tracking: TrackingEndpoint | None = None
        if "MLFLOW_TRACKING_URI" not in launch.variables:  # the job's own server otherwise
            self.tracking = TrackingEndpoint(launch.agent_dir, launch.outputs_dir, launch.node_rank)
            self.tracking.start()
        self.bridge: Bridge | None = None
        if launch.network == "none" and self.tracking is not None and launch.box is not None:
            launch.agent_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.bridge = Bridge(launch.agent_dir / "mlflow.sock", self.tracking, launch.box.user)
            self.bridge.start()
        self.processes: list[ScriptProcess] = []
        for local in locals_:
            rank = launch.node_rank * launch.nproc + (local or 0)
            process_env = script_env(launch, base, self.marker, local, rank)
            if self.tracking is not None:
                name = f"rank-{rank}" if local is not None else f"node-{launch.node_rank}"
                process_env.update(self.tracking.env_for(rank, name, ranks_from_caller=local is None))
            variables = command_variables(launch, process_env, local)
            argv = [expand(arg, variables) for arg in launch.command]
            if _PYTHON_NAMES.match(argv[0]):
                argv[0] = launch.python  # the worker's interpreter (or the job's environment's)
            name = f"rank-{rank}" if local is not None else f"node-{launch.node_rank}"
            self.processes.append(
                ScriptProcess(
                    rank=rank,
                    local_rank=local,
                    argv=argv,
                    env=process_env,
                    cwd=launch.run_dir / "work" / name,
                    log_path=launch.stdout_dir / f"{name}.log",
                    metrics_path=Path(process_env["TORCHYARD_METRICS_FILE"]),
                )
            )
        self.command = self.processes[0].argv
        first = launch.node_rank * launch.nproc
        roots = [(p.cwd, p.rank, False) for p in self.processes]
        roots += [(launch.outputs_dir, first, True), (launch.logs_dir, first, True)]
        # Files mlflow.log_artifact(s) copied to the endpoint's artifact folders are not read.
        skip = mlflow_artifacts(launch.outputs_dir) if self.tracking is not None else None
        self.scalars = ScalarTailer(roots, launch.agent_metrics_dir, self.job_log, skip=skip)
        self.failed: ScriptProcess | None = None
        # ./logs files already judged: their stream name, or None when left out.
        self._log_dir_files: dict[Path, str | None] = {}
        self._log_dir_full = False
        self.stopped = False

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
            _signal_pids([p for p in pids if not sandbox.is_sandbox_process(p)], sig)
            return
        for proc in self.processes:
            if proc.process is not None and proc.process.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.process.pid, sig)
        _signal_pids(pids, sig)

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
        self.sweep()
        codes = [self._returncode(p) for p in self.processes if p.process is not None]
        return next((c for c in codes if c), codes[0] if codes else None)

    def sweep(self, timeout: float = 5.0) -> list[int]:
        """Kill whatever the run left behind (a script's own children)."""
        for proc in self.processes:
            if proc.process is not None and proc.process.poll() is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.process.pid, signal.SIGKILL)
        if self.launch.box is not None:
            shutil.rmtree(self.shared_shm, ignore_errors=True)
        left = self.alive_pids()
        if not left:
            return []
        log.warning("killing %d leftover process(es) of the script: %s", len(left), left)
        _signal_pids(left, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while self.alive_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

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
        """Say in the job's log which files the processes wrote in their working copies (not
        under outputs/ and logs/, which are links to the kept folders, nor under the top
        folders in ``kept``, which the outputs archive takes): they are not kept. A file the
        code package brought, unchanged, was not written. One line a file, or past
        MAX_UNKEPT_NAMED one line a working copy; the files as ``<copy>/<path>``."""
        found: list[str] = []
        kept_names = ["outputs/", "logs/", *(f"{k}/" for k in kept)]
        also = ", ".join(kept_names[:-1]) + " and " + kept_names[-1]
        for cwd in self.working_copies():
            written, scanned_all = _written_files(cwd, self.launch.code_dir, set(kept))
            found += [f"{cwd.name}/{relative}" for relative, _ in written]
            if not written:
                continue
            if len(written) <= MAX_UNKEPT_NAMED:
                for relative, _size in written:
                    self.job_log.warning(
                        "not kept: %s was written in the working copy of %s, not under outputs/ "
                        "(only %s are kept with the job)",
                        relative,
                        cwd.name,
                        also,
                    )
                continue
            models = [r for r, _ in written if r.lower().endswith(MODEL_SUFFIXES)]
            first = list(dict.fromkeys([*models, *(r for r, _ in written)]))[:_UNKEPT_SHOWN]
            self.job_log.warning(
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

    def failure(self, exit_code: int | None) -> dict[str, Any]:
        """``RankFailedError`` (``RankKilledError`` for a signal) naming the rank, the node and its log tail."""
        proc = self.failed or self.processes[0]
        code = exit_code if exit_code is not None else -1
        rank: int | None = proc.rank if proc.local_rank is not None else None
        if proc.local_rank is None:
            cause = _root_cause(proc.log_path)  # the command was torchrun: its own report
            if cause is not None:
                rank, _local, code = cause
        who = f"rank {rank}" if rank is not None else "the command"
        return {
            "code": "RankKilledError" if code < 0 else "RankFailedError",
            "message": f"{who} on node {self.launch.node_name} {_describe_exit(code)}",
            "rank": rank,
            "node": self.launch.node_name,
            "traceback": _tail(proc.log_path, TRACEBACK_TAIL_LINES) or None,
            "secondary": False,
        }


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


# --- inputs ------------------------------------------------------------------------------


def _link_tree(src: Path, dest: Path) -> None:
    """A copy of ``src`` made of hard links (a plain copy across file systems)."""
    tmp = dest.with_name(f".{dest.name}.part")
    shutil.rmtree(tmp, ignore_errors=True)

    def link(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)

    shutil.copytree(src, tmp, copy_function=link)
    # The links share the cache's files: read-only, so a script does not change the
    # dataset under another job by writing into its input (it writes to its outputs).
    for root, _dirs, names in os.walk(tmp):
        for name in names:
            os.chmod(os.path.join(root, name), 0o444)
    os.replace(tmp, dest)


def prepare_script(
    ctx: AgentContext,
    work: ScriptPlacement,
    run_dir: Path,
    stop: threading.Event,
    logger: logging.Logger,
    *,
    agent_dir: Path | None = None,
) -> ScriptLaunch:
    """Fetch the code and the inputs into the node's caches, build the pip environment if
    asked for, and describe the launch."""
    from worker.agent.dataset_cache import fetch_dataset
    from worker.agent.pip_env import ensure_environment

    if work.spec.environment.network == "none" and ctx.sandbox != sandbox.BWRAP:
        raise SandboxUnavailableError(
            f"node {ctx.node_name} cannot give this job a network of its own (environment.network "
            f"none) without its sandbox: {sandbox.unavailable_reason() or 'it is turned off'}"
        )
    if ctx.sandbox == sandbox.UNAVAILABLE:
        raise SandboxUnavailableError(
            f"node {ctx.node_name} runs no script job without its sandbox: {sandbox.unavailable_reason()}; "
            f"install bubblewrap there, or start its agent with {sandbox.SANDBOX_VAR}=off to run scripts "
            "unconfined"
        )

    def fetch(what: str, url: str | None, ref_id: str, sha256: str, cache: Path) -> Path:
        started = time.monotonic()
        folder: Path = retrying(
            lambda: fetch_dataset(ctx.api.client, ref_id, sha256, cache, url=url),
            f"fetching {what} {ref_id}",
            stop=stop,
            deadline=time.monotonic() + FETCH_DEADLINE_S,
        )
        logger.info("%s %s ready in %.2f s", what, ref_id, time.monotonic() - started)
        return folder

    code_dir = fetch(
        "code package",
        f"/v1/worker/code/{work.code.id}/archive",
        work.code.id,
        work.code.sha256,
        ctx.work_dir / "code",
    )
    inputs: dict[str, Path] = {}
    for name, ref in work.inputs.items():
        cached = fetch("input dataset", None, ref.id, ref.sha256, ctx.dataset_cache)
        inputs[name] = run_dir / "inputs" / name
        inputs[name].parent.mkdir(parents=True, exist_ok=True)
        _link_tree(cached, inputs[name])
    spec = work.spec
    env_dir = None
    requirements = list(spec.environment.pip)
    if requirements:
        env_dir, built = ensure_environment(
            ctx.work_dir / "envs",
            requirements,
            stop=stop,
            on_build=logger,
            hidden=[ctx.work_dir],
            timeout_s=spec.environment.build_timeout_s,
        )
        logger.info("pip environment %s %s", env_dir.name, "built" if built else "reused")
    box = None
    if ctx.sandbox == sandbox.BWRAP:
        box = sandbox.Sandbox(
            writable=run_dir,
            hidden=[ctx.work_dir],
            read_only=[*inputs.values(), *([env_dir] if env_dir else [])],
            not_given=[run_dir / "inputs"],
        )
    return ScriptLaunch(
        run_dir=run_dir,
        node_name=ctx.node_name,
        node_rank=work.node_rank,
        node_count=work.node_count,
        nproc=work.process_count_per_node,
        master_addr=work.master_addr,
        master_port=work.master_port,
        cpus=ctx.cpus_for(work.process_count_per_node),
        command=tuple(spec.command),
        launch=spec.distribution.launch,
        variables=dict(spec.environment.variables),
        inputs=inputs,
        code_dir=code_dir,
        env_dir=env_dir,
        socket_ifname=ctx.socket_ifname,
        grace_s=ctx.grace_s,
        box=box,
        own_dir=agent_dir,
        network=spec.environment.network,
    )


# --- outputs -----------------------------------------------------------------------------


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
