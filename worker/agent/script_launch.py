"""How a script job's processes start on one node (docs/script-jobs.md): their command, variables
and environment.

Every process runs the job's ``command`` (no shell; ``$NAME``/``${NAME}`` expanded from
the launch variables and the ``TORCHYARD_*`` paths below only) in a fresh copy of the code, with the variables of docs/script-jobs.md:
``per_process`` starts ``process_count_per_node`` processes each with ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``; ``per_node`` starts one with ``NNODES``, ``NPROC_PER_NODE``,
``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, so the command may be ``torchrun``.

A process's environment is the agent's minus its secrets and every ``TORCHYARD_*``
variable of its own, plus the job's ``environment.variables`` and the paths below, all
inside this placement's run directory: ``TORCHYARD_OUTPUT_DIR`` and ``TORCHYARD_LOG_DIR``
(shared by the node's processes; ``./outputs`` and ``./logs`` in each copy point there),
``TORCHYARD_METRICS_FILE`` and ``TORCHYARD_INPUT_<NAME>`` (a hard-linked copy of the
dataset from the node's cache).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from torchyard.contract.jobspec import input_variable
from worker.agent import sandbox
from worker.agent.job_env import DIST_VARS, SECRET_VARS
from worker.agent.marked_processes import MARKER_VAR
from worker.agent.rank_group import visible_devices

_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*)|(\$))")
_PYTHON_NAMES = re.compile(r"^python(3(\.\d+)?)?$")


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
        if k not in DIST_VARS
        and k not in SECRET_VARS
        and not k.startswith("TORCHYARD_")
        and k != "VIRTUAL_ENV"
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


def command_argv(launch: ScriptLaunch, process_env: Mapping[str, str], local_rank: int | None) -> list[str]:
    """One process's command: ``$NAME`` expanded (:func:`command_variables`), and ``python``
    the worker's interpreter (or the job's environment's)."""
    variables = command_variables(launch, process_env, local_rank)
    argv = [expand(arg, variables) for arg in launch.command]
    if _PYTHON_NAMES.match(argv[0]):
        argv[0] = launch.python
    return argv
