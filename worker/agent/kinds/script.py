"""Script jobs on the agent (docs/script-jobs.md): the user's command per process or per node, in its
sandbox; the outputs folder is uploaded at the end (node rank 0, or every node with
``"outputs": "all"``), succeeded or failed."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import ClassVar

from torchyard.contract.errors import RankFailedError
from torchyard.contract.failures import FailureReport
from torchyard.contract.jobspec import JobKind
from torchyard.contract.protocol import ScriptPlacement
from worker.agent.kinds.base import KindRun, PlacementHost
from worker.agent.reporting import RunReporter
from worker.agent.script_inputs import prepare_script
from worker.agent.script_launch import ScriptLaunch
from worker.agent.script_outputs import LIGHTNING_LOGS, upload_outputs_of
from worker.agent.script_run import ScriptGroup


class ScriptRun(KindRun):
    kind: ClassVar[JobKind] = JobKind.SCRIPT

    def __init__(self, host: PlacementHost) -> None:
        super().__init__(host)
        work = host.work
        assert isinstance(work, ScriptPlacement)
        self.work = work
        self.launched: ScriptLaunch | None = None
        self.group: ScriptGroup | None = None

    def describe(self) -> None:
        h, w = self.host, self.work
        h.log.info(
            "job %s attempt %d (script, %s): node rank %d of %d, %d process(es) per node, master %s:%d",
            h.job_id,
            w.attempt_number,
            w.spec.distribution.launch,
            h.node_rank,
            w.node_count,
            h.units,
            w.master_addr,
            w.master_port,
        )

    def prepare(self) -> None:
        h = self.host
        self.launched = prepare_script(
            h.ctx, self.work, h.run_dir, h.stop_event, h.log, agent_dir=h.agent_dir
        )

    def launch(self, agent_log: Path) -> tuple[ScriptGroup, RunReporter | None]:
        h = self.host
        assert self.launched is not None
        launch = self.launched = dataclasses.replace(self.launched, gpu_ids=h.gpu_ids)
        group = self.group = ScriptGroup(launch, job_log=h.log)
        h.group = group
        try:
            with open(agent_log, "a", encoding="utf-8") as out:
                pid = group.start(out)
            h.log.info("script started (pid %d): %s", pid, shlex.join(group.command))
            reporter = h.start_reporter(
                group.log_files, agent_log, group.metric_files, tracking_source=group.tracking_source
            )
            # Each process's CPU, memory and GPU (worker/agent/script_sys_metrics.py), at the
            # latest step the script logged.
            group.start_sampling(reporter.reader.latest_step if isinstance(reporter, RunReporter) else None)
        except BaseException:
            group.close_tracking()
            raise
        return group, reporter

    def close(self) -> None:
        # The MLflow endpoint ends with the processes; TensorBoard files are read a last time.
        if self.group is not None:
            self.group.close_tracking()

    def outcome(self, exit_code: int | None, agent_log: Path) -> tuple[str, FailureReport | None]:
        h = self.host
        assert self.group is not None and self.launched is not None
        h.log.info("script ended: exit code %s", exit_code)
        # The working copies' lightning_logs/ go into the outputs archive of a node that keeps its outputs.
        self.group.name_unkept_files(kept=(LIGHTNING_LOGS,) if self._keeps_outputs() else ())
        state, failure = "stopped", None
        if not h.stop_event.is_set():
            state = "succeeded" if exit_code == 0 else "failed"
            failure = None if exit_code == 0 else self.group.failure(exit_code)
        if state != "stopped" or h.stop_kind == "attempt_ended":
            state, failure = self._keep_outputs(state, failure)
        if failure is not None:
            h.log.error(
                "job %s failed: %s (rank %s): %s",
                h.job_id,
                failure.code,
                failure.rank,
                failure.message,
            )
        return state, failure

    def _keeps_outputs(self) -> bool:
        """Whether this node uploads its outputs: node rank 0, or every node with outputs "all"."""
        return self.host.node_rank == 0 or self.work.spec.outputs == "all"

    def _keep_outputs(self, state: str, failure: FailureReport | None) -> tuple[str, FailureReport | None]:
        """Upload the output folder (node rank 0; every node with outputs "all"), succeeded
        or failed. A success whose outputs cannot be kept is a failure."""
        h = self.host
        assert self.launched is not None and self.group is not None
        if not self._keeps_outputs():
            return state, failure
        try:
            upload_outputs_of(
                h.session,
                self.launched.outputs_dir,
                self.launched.logs_dir,
                lambda text: h.log.warning("outputs: %s", text),
                outage_deadline=h.report.outage_deadline(),
                archive_dir=self.launched.agent_dir,
                lightning_logs=[cwd / LIGHTNING_LOGS for cwd in self.group.working_copies()],
            )
        except Exception as exc:
            h.log.error("job %s: the outputs could not be uploaded: %s", h.job_id, exc)
            if state == "succeeded":
                message = f"the outputs of node {h.ctx.node_name} could not be uploaded: {exc}"
                return "failed", FailureReport(
                    code=RankFailedError.code, message=message, node=h.ctx.node_name
                )
        return state, failure
