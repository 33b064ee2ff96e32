"""The built-in trainer under torchrun: what training jobs and evaluations share.

Prepare fetches the datasets, the initial model and the checkpoint and writes
``job.json``; launch starts torchrun with its reporter (and node rank 0's checkpoint
uploader); the outcome reads the ranks' failure files when torchrun failed.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import ClassVar

from torchyard.contract.failures import FailureReport
from torchyard.contract.jobfile import JobConfig, TrainerTask
from torchyard.contract.metrics import SYS_METRICS_FILE_PATTERN
from torchyard.contract.protocol import EvaluatePlacement, TrainPlacement
from worker.agent import sandbox
from worker.agent.kinds.base import KindRun, PlacementHost
from worker.agent.rank_failures import collect_failure, rank_log_files, read_failure_files
from worker.agent.rank_group import LaunchSpec, RankGroup
from worker.agent.reporting import RunReporter
from worker.agent.run_inputs import RunInputs
from worker.agent.sandbox import Sandbox
from worker.agent.watchdog import PREEMPTED_FILE


class TrainerRun(KindRun):
    """A placement that runs the trainer program on every rank."""

    task: ClassVar[TrainerTask]
    hands_back_when_draining = True

    def __init__(self, host: PlacementHost) -> None:
        super().__init__(host)
        work = host.work
        assert isinstance(work, TrainPlacement | EvaluatePlacement)
        self.work = work
        self.job: JobConfig | None = None
        self.spec: LaunchSpec | None = None

    def describe(self) -> None:
        h, w = self.host, self.work
        h.log.info(
            "job %s attempt %d: node rank %d of %d, %d process(es) per node, rendezvous %s:%d, run dir %s",
            h.job_id,
            w.attempt_number,
            h.node_rank,
            w.node_count,
            h.units,
            w.master_addr,
            w.master_port,
            h.run_dir,
        )

    def prepare(self) -> None:
        h = self.host
        self.job = RunInputs(
            h.ctx, self.work, h.run_dir, h.stop_event, h.log, session=h.session, task=self.task
        ).prepare()

    def launch(self, agent_log: Path) -> tuple[RankGroup, RunReporter | None]:
        h = self.host
        spec = self.spec = self._launch_spec()
        group = RankGroup(spec)
        h.group = group
        with open(agent_log, "a", encoding="utf-8") as out:
            pid = group.start(out)
        h.log.info("torchrun started (pid %d): %s", pid, shlex.join(group.command))
        # Each rank's system metrics (worker/trainer/system_metrics.py) go with the job's metrics.
        reporter = h.start_reporter(lambda: rank_log_files(spec), agent_log, self._sys_metric_files)
        self.start_guards(spec, group)
        return group, reporter

    def _sys_metric_files(self) -> list[Path]:
        return sorted(self.host.run_dir.glob(SYS_METRICS_FILE_PATTERN))

    def start_guards(self, spec: LaunchSpec, group: RankGroup) -> None:
        """Node rank 0's checkpoint uploader."""
        h = self.host
        if h.node_rank == 0:
            h.uploader = h.session.checkpoint_uploader(h.run_dir, h.log)
            h.uploader.start()

    def _launch_spec(self) -> LaunchSpec:
        h, w = self.host, self.work
        return LaunchSpec(
            run_dir=h.run_dir,
            node_name=h.ctx.node_name,
            node_rank=h.node_rank,
            node_count=w.node_count,
            nproc=h.units,
            master_addr=w.master_addr,
            master_port=w.master_port,
            cpus=h.ctx.cpus_for(h.units),
            gpu_ids=h.gpu_ids,
            socket_ifname=h.ctx.socket_ifname,
            box=self._sandbox(),
            shielded=h.ctx.shielded,
        )

    def _sandbox(self) -> Sandbox | None:
        """The ranks see the run directory, and read-only their datasets, initial model or
        pretrained weights and the offline torch hub (worker.agent.sandbox)."""
        h = self.host
        if h.ctx.sandbox != sandbox.BWRAP:
            return None
        assert self.job is not None
        inputs = [self.job.train_dir, self.job.val_dir, self.job.init_from_dir, self.job.model.weights_file]
        read_only = [Path(p) for p in inputs if isinstance(p, str)]
        read_only.append(sandbox.torch_hub_dir(os.environ))
        # The node's cache of decoded training images, beside the dataset cache, where the
        # trainer looks for it (worker/trainer/image_cache.py): writable, for training ranks only.
        images = h.ctx.work_dir / "image-cache"
        images.mkdir(parents=True, exist_ok=True)
        box = Sandbox(
            writable=h.run_dir,
            hidden=[h.ctx.work_dir],
            read_only=read_only,
            gpus=bool(h.gpu_ids),
            binds=[(images, str(images))],
        )
        if box.user is not None:
            os.chown(images, *box.user)
        return box

    def succeeded(self) -> FailureReport | None:
        """What the ranks' success still needs (an upload): the failure if that went wrong."""
        return None

    def outcome(self, exit_code: int | None, agent_log: Path) -> tuple[str, FailureReport | None]:
        h = self.host
        h.log.info("torchrun ended: exit code %s", exit_code)
        if h.stop_event.is_set():
            return "stopped", None
        if h.hang is not None:
            return "failed", h.hang
        if h.preempt_event.is_set():
            if not (h.run_dir / PREEMPTED_FILE).is_file():
                h.log.warning("the ranks did not finish their preemption checkpoint: the latest one counts")
            return "preempted", None
        if exit_code == 0:
            failure = self.succeeded()
            return ("failed", failure) if failure is not None else ("succeeded", None)
        assert self.spec is not None
        failure = collect_failure(self.spec, exit_code, agent_log)
        # A rank that wrote its failure file printed its message in the job's log already.
        printed = any(r.get("message") == failure.message for r in read_failure_files(self.spec.run_dir))
        h.log.error(
            "job %s failed: %s (rank %s on %s): %s",
            h.job_id,
            failure.code,
            failure.rank,
            failure.node,
            "its error is in the rank's log above" if printed else failure.message,
        )
        if failure.secondary and self.work.node_count > 1:
            # Probably the echo of a failure elsewhere: give the node where it started
            # time to report it (or the API time to notice that node is gone).
            patience = h.ctx.lease_timeout_s + 2 * h.ctx.heartbeat_interval_s
            h.log.info("waiting up to %.0f s for the root cause to be reported elsewhere", patience)
            h.stop_event.wait(patience)
        return ("stopped", None) if h.stop_event.is_set() else ("failed", failure)
