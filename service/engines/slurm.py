"""The Slurm driver (docs/slurm.md): jobs run on an existing Slurm cluster, Slurm doing the scheduling.

The port's four operations (:mod:`service.engines.base`) in Slurm's commands, as the API's
own Unix user runs them (:mod:`service.engines.slurm_cli`):

1. **inventory**: ``sinfo`` of the partitions: units are GPUs from the gres column, else
   CPUs; Slurm's ``down``/``*`` states make a node lost, ``drain`` drained;
2. **submit**: one ``sbatch --parsable`` named ``torchyard-<job id>-<attempt>`` — unless
   Slurm already has a job of that name submitted by the API's own Slurm user (an API that
   died between ``sbatch`` and its commit never submits twice; another user's job of that
   name is never adopted: every ``squeue`` is limited to that user and each job's user is
   checked). All nodes at once (``-N n --ntasks-per-node=1``: Slurm's allocation is the
   gang), ``--gres=gpu:P`` on GPU nodes, ``-c P`` on CPU ones, ``--no-requeue``
   (torchyard resubmits itself), ``--time`` from ``max_runtime_s``,
   ``--signal=USR1@<grace>``; the script ``exec srun``s the launcher on every node;
3. **poll**: ``squeue`` says what pends (with Slurm's reason), runs or ended; for an ended
   job ``scontrol -o show job`` adds its exit code, and the tail of its output file is
   read: ``CANCELLED`` is a cancel from outside, ``PREEMPTED``/``TIMEOUT`` a preemption,
   ``NODE_FAIL`` a lost node;
4. **cancel**: ``scancel``, limited to the API's user.

What those answers mean for attempts and jobs is the reconciler's
(:mod:`service.services.reconciler`), the same for every engine.
"""

from __future__ import annotations

import logging
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from service.config import Settings
from service.engines.base import (
    Capabilities,
    Ending,
    EngineJobState,
    EngineNotAnswering,
    EngineUnavailable,
    LaunchRequest,
    NodeSeen,
    Phase,
    SubmitRefused,
)
from service.engines.slurm_cli import Slurm, SlurmCommandError, SlurmJob, SlurmNode, missing_commands
from service.states import EngineName
from torchyard.contract.states import NodeStatus

log = logging.getLogger(__name__)

OUTPUT_TAIL_BYTES = 4000
# What sbatch says (exit code 1, as for a refusal) when the controller is down.
_UNREACHABLE = "Unable to contact slurm controller"
# How Slurm's end states map onto the port's (any other ended state is a failure).
_ENDINGS = {
    "COMPLETED": Ending.COMPLETED,
    "CANCELLED": Ending.CANCELLED,
    "PREEMPTED": Ending.PREEMPTED,
    "TIMEOUT": Ending.PREEMPTED,  # the allocation's time limit: checkpointed like a preemption
    "NODE_FAIL": Ending.NODE_LOST,
}

# Slurm schedules; its nodes are known from sinfo, and squeue/scontrol say how a job ended.
SLURM_CAPABILITIES = Capabilities(schedules=True, nodes_heartbeat=False, reports_ends=True)


@dataclass
class SlurmDriver:
    settings: Settings
    slurm: Slurm = field(default_factory=Slurm)
    name: EngineName = EngineName.SLURM
    display_name: str = "Slurm"
    cancel_verb: str = "scancel'ed"
    capabilities: Capabilities = SLURM_CAPABILITIES
    partitions: list[str] = field(default_factory=list)
    # Whether the partitions' nodes have GPUs (gres): jobs then ask for GPUs, else CPUs.
    gpus: bool = False
    launcher: str = field(init=False)

    @property
    def period_s(self) -> float | None:
        return self.settings.slurm_poll_s

    def __post_init__(self) -> None:
        self.launcher = self.settings.slurm_launcher

    # --- start ----------------------------------------------------------------------------

    def start(self) -> None:
        """Check the commands and partitions: one clear line when something is missing."""
        missing = missing_commands()
        if missing:
            raise EngineUnavailable(
                f"TORCHYARD_ENGINE=slurm: Slurm's {', '.join(missing)} not found on PATH "
                "(install slurm-client on the API's machine)"
            )
        wanted = [p.strip() for p in self.settings.slurm_partitions.split(",") if p.strip()]
        try:
            if not wanted:
                default = self.slurm.default_partition()
                if default is None:
                    raise EngineUnavailable(
                        "TORCHYARD_ENGINE=slurm: the Slurm cluster has no default partition"
                    )
                wanted = [default]
            known = {p for node in self.slurm.nodes([]) for p in node.partitions}
        except SlurmCommandError as exc:
            raise EngineUnavailable(f"TORCHYARD_ENGINE=slurm: Slurm does not answer: {exc}") from exc
        unknown = [p for p in wanted if p not in known]
        if unknown:
            raise EngineUnavailable(
                f"TORCHYARD_SLURM_PARTITIONS: no partition {', '.join(unknown)} in this Slurm cluster "
                f"(it has {', '.join(sorted(known)) or 'none'})"
            )
        self.partitions = wanted
        self.settings.slurm_outputs.mkdir(parents=True, exist_ok=True)
        for partition in wanted:
            grace = self.slurm.partition_grace_s(partition)
            if grace and self.settings.preempt_grace_s > grace:
                log.warning(
                    "TORCHYARD_PREEMPT_GRACE_S is %g s but partition %s gives preempted jobs %d s "
                    "(GraceTime): checkpoints may be cut short",
                    self.settings.preempt_grace_s,
                    partition,
                    grace,
                )
        log.info("Slurm engine: partitions %s, launcher %r", ",".join(wanted), self.settings.slurm_launcher)

    # --- inventory ------------------------------------------------------------------------

    def inventory(self) -> list[NodeSeen]:
        try:
            nodes = self.slurm.nodes(self.partitions)
        except SlurmCommandError as exc:
            raise EngineNotAnswering(str(exc)) from exc
        self.gpus = any(n.gpus for n in nodes)
        return [_seen(n) for n in nodes]

    # --- submit ---------------------------------------------------------------------------

    def submit(self, request: LaunchRequest) -> str:
        try:
            # Only the API's own Slurm user's jobs are seen (Slurm.queue, job_ids_named): a job
            # of this name that someone else submitted is not adopted.
            existing = self.slurm.job_ids_named(request.name)
        except SlurmCommandError as exc:  # squeue, not sbatch: Slurm did not answer
            raise EngineNotAnswering(str(exc)) from exc
        try:
            if existing:
                log.warning(
                    "job %s: Slurm already has %s (job %s): not submitted again",
                    request.job_id,
                    request.name,
                    existing[0],
                )
                return existing[0]
            argv, env = self.sbatch_command(request)
            return self.slurm.submit(argv, env)
        except SlurmCommandError as exc:
            if exc.code in (124, 127) or _UNREACHABLE in exc.output:
                # No answer, no sbatch, or no controller: try again at the next pass.
                raise EngineNotAnswering(str(exc)) from exc
            raise SubmitRefused(f"sbatch refused the job: {exc.output.strip()[-1000:] or exc}") from exc

    def sbatch_command(self, request: LaunchRequest) -> tuple[list[str], dict[str, str]]:
        """``sbatch``'s options and environment for one attempt (its batch script written)."""
        settings = self.settings
        out_dir = settings.slurm_outputs
        out_dir.mkdir(parents=True, exist_ok=True)
        launcher = shlex.split(settings.slurm_launcher)
        launcher += ["--api", str(settings.slurm_api_url), "--attempt", request.attempt_id]
        if settings.slurm_work_dir:
            launcher += ["--work-dir", settings.slurm_work_dir]
        name = request.name
        script = out_dir / f"{name}.sh"
        script.write_text(
            "#!/bin/sh\n# torchyard: one launcher per node runs this attempt's placement there.\n"
            f"exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 {shlex.join(launcher)}\n",
            encoding="utf-8",
        )
        p = request.process_count_per_node
        argv = [
            "-J", name,
            "-p", ",".join(self.partitions),
            "-N", str(request.node_count),
            "--ntasks-per-node=1",
            f"--gres=gpu:{p}" if self.gpus else f"--cpus-per-task={p}",
            "--no-requeue",
            f"--signal=USR1@{math.ceil(settings.preempt_grace_s)}",
            f"--output={out_dir / f'{name}-%j.out'}",
            f"--chdir={out_dir}",
        ]  # fmt: skip
        if request.max_runtime_s is not None and request.max_runtime_s > 0:
            argv.append(f"--time={max(1, math.ceil(request.max_runtime_s / 60))}")
        if request.account:
            argv.append(f"--account={request.account}")  # the job's team's (docs/teams.md)
        argv += shlex.split(settings.slurm_sbatch_args)
        argv.append(str(script))
        env = dict(self.slurm.env)
        env["TORCHYARD_LAUNCH_TOKEN"] = request.launch_token
        env["TORCHYARD_PREEMPT_GRACE_S"] = f"{settings.preempt_grace_s:g}"
        return argv, env

    # --- poll -----------------------------------------------------------------------------

    def poll(self, ids: Sequence[str]) -> dict[str, EngineJobState]:
        if not ids:
            return {}
        try:
            queue = self.slurm.queue()
            return {slurm_id: self._state(slurm_id, queue.get(slurm_id)) for slurm_id in ids}
        except SlurmCommandError as exc:
            raise EngineNotAnswering(str(exc)) from exc

    def _state(self, slurm_id: str, job: SlurmJob | None) -> EngineJobState:
        if job is not None and not job.ended:
            phase = Phase.PENDING if job.state == "PENDING" else Phase.RUNNING
            return EngineJobState(id=slurm_id, phase=phase, state=job.state, reason=job.reason)
        # Ended (or forgotten: Slurm keeps a finished job MinJobAge seconds).
        shown = self.slurm.show_job(slurm_id)
        state = job.state if job is not None else (shown.get("JobState") or "FORGOTTEN").split()[0]
        reason = shown.get("Reason") or (job.reason if job is not None else "") or "none"
        name = job.name if job is not None and job.name else shown.get("JobName", "")
        summary = (
            f"Slurm job {slurm_id} ended {state} (exit code {shown.get('ExitCode', '?')}, reason {reason})"
        )
        return EngineJobState(
            id=slurm_id,
            phase=Phase.ENDED,
            state=state,
            reason=reason,
            ending=_ENDINGS.get(state, Ending.FAILED),
            summary=summary,
            output_tail=self._output_tail(name, slurm_id),
        )

    def _output_tail(self, name: str, slurm_id: str) -> str:
        path = self.settings.slurm_outputs / f"{name}-{slurm_id}.out"
        if not name:  # a job Slurm forgot has no name any more: its output file still has it
            path = next(iter(sorted(self.settings.slurm_outputs.glob(f"torchyard-*-{slurm_id}.out"))), path)
        tail = read_tail(path)
        if tail is None:
            return f"(no output at {path}: TORCHYARD_SLURM_OUTPUT_DIR must be storage the API shares)"
        return tail

    # --- cancel ---------------------------------------------------------------------------

    def cancel(self, engine_job_id: str) -> None:
        log.info("scancel %s: its attempt is over", engine_job_id)
        self.slurm.cancel(engine_job_id)


def _seen(node: SlurmNode) -> NodeSeen:
    status = NodeStatus(node.status)
    return NodeSeen(
        name=node.name,
        address=node.address,
        units=node.units,
        accelerator="gpu" if node.gpus else "cpu",
        status=status,
        state=node.state,
        why=f"node {node.name} is {node.state} in Slurm" if status is not NodeStatus.READY else "",
        info={"partitions": list(node.partitions), "gpus": node.gpus, "cpus": node.cpus},
    )


def read_tail(path: Path, size: int = OUTPUT_TAIL_BYTES) -> str | None:
    """The last ``size`` bytes of a text file, or None when it cannot be read."""
    try:
        with open(path, "rb") as fh:
            end = fh.seek(0, 2)
            fh.seek(max(0, end - size))
            return fh.read().decode("utf-8", errors="replace").strip()
    except OSError:
        return None
