"""Training jobs on the agent: the trainer under torchrun, watched for hangs; node rank 0
uploads its checkpoints as they come and the model directory at the end."""

from __future__ import annotations

from typing import ClassVar

from torchyard.contract.failures import FailureReport
from torchyard.contract.jobfile import TrainerTask
from torchyard.contract.jobspec import JobKind
from worker.agent.kinds.trainer import TrainerRun
from worker.agent.rank_group import LaunchSpec, RankGroup
from worker.agent.watchdog import HangWatchdog


class TrainRun(TrainerRun):
    kind: ClassVar[JobKind] = JobKind.TRAIN
    task = TrainerTask.TRAIN

    def start_guards(self, spec: LaunchSpec, group: RankGroup) -> None:
        """The checkpoint uploader, and the hang watchdog when the job asks for one
        (training steps feed it)."""
        super().start_guards(spec, group)
        h = self.host
        timeout = self.work.spec.resources.hang_timeout_s
        if timeout is not None and timeout > 0:
            root = group.process.pid if group.process else None
            h.watchdog = HangWatchdog(h.run_dir, float(timeout), spec, h.log, root_pid=root)

    def succeeded(self) -> FailureReport | None:
        """Node rank 0 uploads the model directory before it reports success."""
        h = self.host
        return h.report.upload_model(h.run_dir) if h.node_rank == 0 else None
