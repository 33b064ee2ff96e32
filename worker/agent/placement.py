"""One claimed placement, from its datasets to its final status report, in a thread of its own.

Order matters at the end: the ranks have exited (or been stopped) → leftovers are
swept → node rank 0 uploads the model → the reporter ships the last metrics and log
lines → the final status goes out (the lease ends there, later writes would be 409).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from torchyard.contract.errors import RankFailedError
from torchyard.contract.failures import FailureReport
from torchyard.contract.protocol import ClaimedPlacement, StopOrder
from worker.agent.checkpoints import CheckpointUploader
from worker.agent.context import AgentContext
from worker.agent.kinds import KindRun, run_for
from worker.agent.lease import LeaseSession
from worker.agent.rank_group import RankGroup
from worker.agent.reporting import RunReporter
from worker.agent.run_inputs import prepare_failure
from worker.agent.run_outcome import OutcomeReport, StopKind
from worker.agent.script_run import ScriptGroup
from worker.agent.watchdog import PREEMPT_REQUEST_FILE, HangWatchdog, preempt_grace_s

__all__ = ["AGENT_LOG", "AgentContext", "PlacementRun", "apply_stop_orders"]

log = logging.getLogger(__name__)

AGENT_LOG = "agent.log"
# How long the last metrics and log lines of a run wait for an unreachable API (restarted,
# upgraded, its database down): the placement's final status waits behind them, and the
# heartbeat keeps its lease meanwhile. The agent shutting down cuts this short.
REPORTER_FLUSH_S = 24 * 3600.0
# How long a failed attempt's node waits for its newest checkpoint to be uploaded.
CHECKPOINT_FLUSH_S = 60.0


def apply_stop_orders(orders: list[StopOrder], active: list[PlacementRun]) -> None:
    """Pass a heartbeat's stop orders to the placements they name (an agent's or a launcher's)."""
    by_lease = {p.lease_token: p for p in active}
    for order in orders:
        placement = by_lease.get(order.lease_token)
        if placement is None or placement.stop_event.is_set():
            continue
        log.info("job %s: stop (%s): %s", placement.job_id, order.reason, order.message)
        if order.reason == "preempted":
            placement.request_preempt(order.message)
        else:
            placement.request_stop(order.reason, order.message)


class _RunLog:
    """The log of one placement: a file in the agent's folder of it (shipped as the
    ``agent-<node>`` stream) that also reaches the agent's own log."""

    def __init__(self, path: Path, job_id: str) -> None:
        self.path = path
        self.logger = logging.getLogger(f"worker.agent.run.{job_id}")
        self.handler = logging.FileHandler(path, encoding="utf-8")
        self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s agent: %(message)s"))
        self.logger.addHandler(self.handler)

    def close(self) -> None:
        self.logger.removeHandler(self.handler)
        self.handler.close()


class PlacementRun:
    """A claimed placement: prepares, launches, watches, stops and reports its ranks.

    What differs by job kind (its inputs, its processes, its outcome) is the kind's
    :class:`~worker.agent.kinds.base.KindRun`; its reports to the API go through
    :class:`OutcomeReport` in its :class:`~worker.agent.lease.LeaseSession`.
    """

    def __init__(
        self,
        ctx: AgentContext,
        work: ClaimedPlacement,
        unit_ids: tuple[int, ...],
        *,
        gpu_ids: tuple[int, ...] = (),
    ) -> None:
        self.ctx = ctx
        self._work = work
        self.unit_ids = unit_ids
        self.gpu_ids = gpu_ids
        self.job_id = work.job_id
        self.lease_token = work.lease_token
        self.session = LeaseSession(ctx.api, work.job_id, work.lease_token)
        self.node_rank = work.node_rank
        self.units = work.process_count_per_node
        name = f"{self.job_id}-a{work.attempt_number}-{ctx.node_name}"
        self.run_dir = ctx.runs_dir / name
        self.agent_dir = ctx.placements_dir / name
        self.stop_event = threading.Event()
        self.stop_kind: StopKind | None = None
        self.stop_message = ""
        self.group: RankGroup | ScriptGroup | None = None
        # Preemption: asked (the ranks checkpoint at their next step boundary), and by when.
        self.preempt_event = threading.Event()
        self.preempt_message = ""
        self.preempt_deadline = 0.0
        self.uploader: CheckpointUploader | None = None
        self.watchdog: HangWatchdog | None = None
        self.hang: FailureReport | None = None
        self.log = log
        self.report = OutcomeReport(ctx, self.session, self.request_stop, log)
        self.thread = threading.Thread(target=self._main, name=f"run-{self.job_id[:8]}")

    @property
    def work(self) -> ClaimedPlacement:
        return self._work

    @property
    def final_state(self) -> str | None:
        return self.report.final_state

    def start(self) -> None:
        self.thread.start()

    def request_preempt(self, message: str) -> None:
        """Ask the ranks to checkpoint at their next step boundary and stop; the placement
        then reports ``preempted`` (a drain or the agent's SIGTERM). Past the grace period
        (``TORCHYARD_PREEMPT_GRACE_S``) the ranks are stopped anyway."""
        if self.preempt_event.is_set() or self.stop_event.is_set():
            return
        self.preempt_message = message
        self.preempt_deadline = time.monotonic() + preempt_grace_s()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / PREEMPT_REQUEST_FILE).write_text(message, encoding="utf-8")
        self.preempt_event.set()
        self.log.info("job %s: preempting (%s)", self.job_id, message)

    def request_stop(self, kind: StopKind, message: str) -> None:
        """Ask the ranks to stop (from the heartbeat thread or the agent's shutdown)."""
        if not self.stop_event.is_set():
            self.stop_kind = kind
            self.stop_message = message
            self.stop_event.set()

    # --- the thread ------------------------------------------------------------------------

    def _main(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.agent_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        runlog = _RunLog(self.agent_dir / AGENT_LOG, self.job_id)
        self.log = self.report.log = runlog.logger
        try:
            self._run(runlog.path)
        except Exception as exc:
            self.log.exception("job %s: the agent failed running its placement", self.job_id)
            if self.group is not None:
                self.group.stop(self.ctx.grace_s)
            if self.final_state is None:
                message = f"the worker agent on node {self.ctx.node_name} failed: {type(exc).__name__}: {exc}"
                self.report.finish(
                    "failed",
                    None,
                    FailureReport(code=RankFailedError.code, message=message, node=self.ctx.node_name),
                )
        finally:
            if self.group is not None:
                self.group.kill_stragglers()
            runlog.close()
            self.ctx.release(self)

    def _run(self, agent_log: Path) -> None:
        """Every kind's course: prepare, launch, watch, decide, then report (the kind's
        uploads first, the reporter's last lines next, the final status last)."""
        kind = run_for(self)
        kind.describe()
        if not self._prepare(kind):
            return
        if kind.hands_back_when_draining and self.preempt_event.is_set():
            # Claimed while the node drains: hand it back untouched.
            self.report.finish("preempted", None, None)
            return
        group, reporter = kind.launch(agent_log)
        try:
            self.report.report_running(self.stop_event)
            exit_code = self._watch(group, reporter)
        finally:
            kind.close()
        state, failure = kind.outcome(exit_code, agent_log)
        if self.uploader is not None:
            # A preempted or failed attempt's restart resumes from the newest checkpoint: send it first.
            self.uploader.stop(self._upload_patience(state))
        if reporter is not None:
            reporter.stop(REPORTER_FLUSH_S)
        if state == "preempted":
            self.report.finish("preempted", exit_code, None)
        elif state == "stopped":
            self.report.finish_stopped(self.stop_kind, exit_code)
        else:
            self.report.finish(state, exit_code, failure)

    def _prepare(self, kind: KindRun) -> bool:
        """The kind's inputs; False when the placement already ended (reported)."""
        try:
            kind.prepare()
        except Exception as exc:
            if self.stop_event.is_set():
                self.report.finish_stopped(self.stop_kind, None)
            else:
                self.report.finish("failed", None, prepare_failure(exc, self.ctx.node_name, self.log))
            return False
        if self.stop_event.is_set():
            self.report.finish_stopped(self.stop_kind, None)
            return False
        return True

    def _upload_patience(self, state: str) -> float:
        if state == "preempted":
            return max(5.0, self.preempt_deadline - time.monotonic())
        if state == "failed":
            return CHECKPOINT_FLUSH_S
        return 0.0

    def start_reporter(
        self,
        log_sources: Callable[[], list[tuple[str, Path]]],
        agent_log: Path,
        metric_sources: Callable[[], list[Path]] | None = None,
        *,
        tracking_source: Callable[[], bytes | None] | None = None,
    ) -> RunReporter | None:
        """Start shipping the run's metrics and log lines under the lease."""
        reporter = self.session.reporter(
            self.run_dir,
            log_sources,
            agent_log,
            self.ctx.node_name,
            max_log_backlog=self.ctx.log_backlog_bytes,
            abandon=self.ctx.leaving,
            metric_sources=metric_sources,
            tracking_source=tracking_source,
        )
        reporter.start()
        return reporter

    def _watch(self, group: RankGroup | ScriptGroup, reporter: RunReporter | None) -> int | None:
        while True:
            code = group.wait(0.2)
            if code is not None:
                group.kill_stragglers()
                return code
            if reporter is not None and reporter.lease_lost:
                self.request_stop("stale", "the API refused the lease (409)")
            if self.uploader is not None and self.uploader.lease_lost:
                self.request_stop("stale", "the API refused the lease (409)")
            if self.stop_event.is_set():
                return self._stop_ranks(group)
            if self.preempt_event.is_set() and time.monotonic() > self.preempt_deadline:
                self.log.warning("the ranks did not stop within the preemption grace period: stopping them")
                return self._stop_ranks(group)
            if self.watchdog is not None and not self.preempt_event.is_set():
                hang = self.watchdog.check()
                if hang is not None:
                    self.hang = hang
                    self.watchdog.dump_stacks()
                    return self._stop_ranks(group)

    def _stop_ranks(self, group: RankGroup | ScriptGroup) -> int | None:
        kind: str | None = self.stop_kind
        message = self.stop_message
        if kind is None:
            kind, message = (
                ("HangError", "hung") if self.hang is not None else ("preempted", self.preempt_message)
            )
        self.log.info(
            "stopping the ranks (%s: %s): SIGTERM, SIGKILL after %.0f s", kind, message, self.ctx.grace_s
        )
        started = time.monotonic()
        code = group.stop(self.ctx.grace_s)
        self.log.info("ranks stopped in %.2f s", time.monotonic() - started)
        return code
