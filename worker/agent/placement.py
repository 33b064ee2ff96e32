"""One claimed placement, from its datasets to its final status report, in a thread of its own.

Order matters at the end: the ranks have exited (or been stopped) → leftovers are
swept → node rank 0 uploads the model → the reporter ships the last metrics and log
lines → the final status goes out (the lease ends there, later writes would be 409).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchyard.contract.errors import RankFailedError
from torchyard.contract.protocol import ClaimedPlacement
from worker.agent import sandbox
from worker.agent.api import WorkerApi
from worker.agent.checkpoints import CheckpointUploader
from worker.agent.launcher import JOB_FILE, LaunchSpec, RankGroup, collect_failure, rank_log_files
from worker.agent.run_files import DEFAULT_LOG_BACKLOG_BYTES
from worker.agent.run_inputs import RunInputs, prepare_failure
from worker.agent.run_outcome import OutcomeReport, StopKind
from worker.agent.sandbox import Sandbox
from worker.agent.script_run import ScriptGroup, prepare_script, upload_outputs
from worker.agent.watchdog import PREEMPT_REQUEST_FILE, PREEMPTED_FILE, HangWatchdog, preempt_grace_s

log = logging.getLogger(__name__)

AGENT_LOG = "agent.log"
# How long the last metrics and log lines of a run wait for an unreachable API (restarted,
# upgraded, its database down): the placement's final status waits behind them, and the
# heartbeat keeps its lease meanwhile. The agent shutting down cuts this short.
REPORTER_FLUSH_S = 24 * 3600.0
# How long a failed attempt's node waits for its newest checkpoint to be uploaded.
CHECKPOINT_FLUSH_S = 60.0


@dataclass
class AgentContext:
    """What every placement of one agent shares."""

    api: WorkerApi
    node_name: str
    work_dir: Path
    cpus: int
    grace_s: float
    socket_ifname: str | None
    lease_timeout_s: float = 15.0
    heartbeat_interval_s: float = 2.0
    release: Callable[[PlacementRun], None] = field(default=lambda run: None)
    # Set when the agent shuts down: waits on an unreachable API are cut short then.
    shutdown: threading.Event = field(default_factory=threading.Event)
    log_backlog_bytes: int = DEFAULT_LOG_BACKLOG_BYTES
    # bwrap, off or unavailable (worker.agent.sandbox): how this node confines its runs.
    sandbox: str = "off"
    # The engine signals every process of the run (Slurm): torchrun and the ranks ignore its
    # SIGTERM and SIGUSR1, which reach the launcher as a preemption (LaunchSpec.shielded).
    shielded: bool = False
    # The node's processing units; 0 when the whole of ``cpus`` is this one placement's (a
    # launcher in an allocation of its own).
    node_units: int = 0

    def cpus_for(self, units: int) -> int:
        """A placement's share of the node's CPUs, by the units it holds: two 1-unit jobs on a
        2-slot, 2-core node get a core each, not two threads each on the same two cores."""
        if self.node_units <= 0:
            return self.cpus
        return max(1, self.cpus * units // self.node_units)

    @property
    def dataset_cache(self) -> Path:
        return self.work_dir / "datasets"

    @property
    def runs_dir(self) -> Path:
        return self.work_dir / "runs"

    @property
    def models_dir(self) -> Path:
        return self.work_dir / "models"


def apply_stop_orders(orders: list[dict[str, Any]], active: list[PlacementRun]) -> None:
    """Pass a heartbeat's stop orders to the placements they name (an agent's or a launcher's)."""
    by_lease = {p.lease_token: p for p in active}
    for order in orders:
        placement = by_lease.get(order.get("lease_token", ""))
        if placement is None or placement.stop_event.is_set():
            continue
        kind = order.get("reason", "stale")
        message = order.get("message", "")
        log.info("job %s: stop (%s): %s", placement.job_id, kind, message)
        if kind == "preempted":
            placement.request_preempt(message)
            continue
        placement.request_stop(kind if kind in ("cancelled", "attempt_ended") else "stale", message)


class _RunLog:
    """The launcher log of one placement: a file in the run directory (shipped as the
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

    Its inputs are :class:`RunInputs`, its reports to the API :class:`OutcomeReport`;
    this class launches torchrun and decides the outcome.
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
        self.work = work
        self.unit_ids = unit_ids
        self.gpu_ids = gpu_ids
        self.job_id = work.job_id
        self.lease_token = work.lease_token
        self.node_rank = work.node_rank
        self.units = work.process_count_per_node
        name = f"{self.job_id}-a{work.attempt_number}-{ctx.node_name}"
        self.run_dir = ctx.runs_dir / name
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
        self.hang: dict[str, Any] | None = None
        self.log = log
        self.report = OutcomeReport(ctx, self.job_id, self.lease_token, self.request_stop, log)
        self.thread = threading.Thread(target=self._main, name=f"run-{self.job_id[:8]}")

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
        runlog = _RunLog(self.run_dir / AGENT_LOG, self.job_id)
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
                    {"code": RankFailedError.code, "message": message, "node": self.ctx.node_name},
                )
        finally:
            if self.group is not None:
                self.group.sweep()
            runlog.close()
            self.ctx.release(self)

    def _run(self, agent_log: Path) -> None:
        if self.work.type == "script":
            self._run_script(agent_log)
        elif self.work.type in ("train", "evaluate"):
            self._run_trainer(agent_log)
        else:
            raise RuntimeError(f"this agent cannot run jobs of type {self.work.type!r}")

    def _run_trainer(self, agent_log: Path) -> None:
        """The built-in trainer (training or evaluation) under torchrun."""
        w = self.work
        self.log.info(
            "job %s attempt %d: node rank %d of %d, %d process(es) per node, rendezvous %s:%d, run dir %s",
            self.job_id,
            w.attempt_number,
            self.node_rank,
            w.node_count,
            self.units,
            w.master_addr,
            w.master_port,
            self.run_dir,
        )
        job_file = self._prepare()
        if job_file is None:
            return
        if self.preempt_event.is_set():
            # Claimed while the node drains: hand it back untouched.
            self.report.finish("preempted", None, None)
            return
        spec = self._launch_spec()
        if spec.job_file != job_file:
            raise RuntimeError(f"job file {job_file} is not where torchrun will look ({spec.job_file})")
        group = self.group = RankGroup(spec)
        with open(agent_log, "a", encoding="utf-8") as out:
            pid = group.start(out)
        self.log.info("torchrun started (pid %d): %s", pid, shlex.join(group.command))
        reporter = self._start_reporter(spec, agent_log)
        self._start_guards(spec)
        self.report.report_running(self.stop_event)

        exit_code = self._watch(group, reporter)
        self.log.info("torchrun ended: exit code %s", exit_code)
        state, failure = self._outcome(spec, exit_code, agent_log)
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

    def _start_guards(self, spec: LaunchSpec) -> None:
        """Node rank 0's checkpoint uploader, and the hang watchdog when the job asks for one."""
        if self.node_rank == 0:
            self.uploader = CheckpointUploader(
                self.ctx.api.client, self.job_id, self.lease_token, self.run_dir, self.log
            )
            self.uploader.start()
        timeout = (self.work.spec.get("resources") or {}).get("hang_timeout_s")
        # Training steps feed the watchdog; an evaluation has none to count.
        if self.work.type == "train" and isinstance(timeout, int | float) and timeout > 0:
            group = self.group
            root = group.process.pid if isinstance(group, RankGroup) and group.process else None
            self.watchdog = HangWatchdog(self.run_dir, float(timeout), spec, self.log, root_pid=root)

    def _upload_patience(self, state: str) -> float:
        if state == "preempted":
            return max(5.0, self.preempt_deadline - time.monotonic())
        if state == "failed":
            return CHECKPOINT_FLUSH_S
        return 0.0

    def _run_script(self, agent_log: Path) -> None:
        """A script job (SPEC §9): the user's command per process or per node."""
        w = self.work
        self.log.info(
            "job %s attempt %d (script, %s): node rank %d of %d, %d process(es) per node, master %s:%d",
            self.job_id,
            w.attempt_number,
            (w.spec.get("distribution") or {}).get("launch", "per_process"),
            self.node_rank,
            w.node_count,
            self.units,
            w.master_addr,
            w.master_port,
        )
        try:
            launch = prepare_script(self.ctx, w, self.run_dir, self.stop_event, self.log)
        except Exception as exc:
            if self.stop_event.is_set():
                self.report.finish_stopped(self.stop_kind, None)
            else:
                self.report.finish("failed", None, prepare_failure(exc, self.ctx.node_name, self.log))
            return
        if self.stop_event.is_set():
            self.report.finish_stopped(self.stop_kind, None)
            return
        launch = dataclasses.replace(launch, gpu_ids=self.gpu_ids)
        group = self.group = ScriptGroup(launch, job_log=self.log)
        try:
            with open(agent_log, "a", encoding="utf-8") as out:
                pid = group.start(out)
            self.log.info("script started (pid %d): %s", pid, shlex.join(group.command))
            reporter = self._start_reporter_for(
                group.log_files, agent_log, group.metric_files, tracking_source=group.tracking_source
            )
            self.report.report_running(self.stop_event)
            exit_code = self._watch(group, reporter)
        finally:
            # The MLflow endpoint ends with the processes; TensorBoard files are read a last time.
            group.close_tracking()
        self.log.info("script ended: exit code %s", exit_code)
        group.name_unkept_files()
        state, failure = "stopped", None
        if not self.stop_event.is_set():
            state = "succeeded" if exit_code == 0 else "failed"
            failure = None if exit_code == 0 else group.failure(exit_code)
        if state != "stopped" or self.stop_kind == "attempt_ended":
            state, failure = self._keep_outputs(launch.outputs_dir, state, failure, launch.logs_dir)
        if failure is not None:
            self.log.error(
                "job %s failed: %s (rank %s): %s",
                self.job_id,
                failure["code"],
                failure.get("rank"),
                failure["message"],
            )
        if reporter is not None:
            reporter.stop(REPORTER_FLUSH_S)
        if state == "stopped":
            self.report.finish_stopped(self.stop_kind, exit_code)
        else:
            self.report.finish(state, exit_code, failure)

    def _keep_outputs(
        self, folder: Path, state: str, failure: dict[str, Any] | None, logs: Path | None = None
    ) -> tuple[str, dict[str, Any] | None]:
        """Upload the output folder (node rank 0; every node with outputs "all"), succeeded
        or failed. A success whose outputs cannot be kept is a failure."""
        if self.node_rank != 0 and self.work.spec.get("outputs") != "all":
            return state, failure
        try:
            upload_outputs(
                self.ctx,
                self.job_id,
                self.lease_token,
                folder,
                logs,
                lambda text: self.log.warning("outputs: %s", text),
                outage_deadline=self.report.outage_deadline(),
            )
        except Exception as exc:
            self.log.error("job %s: the outputs could not be uploaded: %s", self.job_id, exc)
            if state == "succeeded":
                message = f"the outputs of node {self.ctx.node_name} could not be uploaded: {exc}"
                return "failed", {
                    "code": RankFailedError.code,
                    "message": message,
                    "node": self.ctx.node_name,
                }
        return state, failure

    # --- steps -----------------------------------------------------------------------------

    def _prepare(self) -> Path | None:
        """The inputs' ``job.json``, or None when the placement already ended (reported)."""
        try:
            job_file = RunInputs(self.ctx, self.work, self.run_dir, self.stop_event, self.log).prepare()
        except Exception as exc:
            if self.stop_event.is_set():
                self.report.finish_stopped(self.stop_kind, None)
            else:
                self.report.finish("failed", None, prepare_failure(exc, self.ctx.node_name, self.log))
            return None
        if self.stop_event.is_set():
            self.report.finish_stopped(self.stop_kind, None)
            return None
        return job_file

    def _launch_spec(self) -> LaunchSpec:
        w = self.work
        return LaunchSpec(
            run_dir=self.run_dir,
            node_name=self.ctx.node_name,
            node_rank=self.node_rank,
            node_count=w.node_count,
            nproc=self.units,
            master_addr=w.master_addr,
            master_port=w.master_port,
            cpus=self.ctx.cpus_for(self.units),
            gpu_ids=self.gpu_ids,
            socket_ifname=self.ctx.socket_ifname,
            box=self._trainer_sandbox(),
            shielded=self.ctx.shielded,
        )

    def _trainer_sandbox(self) -> Sandbox | None:
        """The ranks see the run directory, and read-only their datasets, initial model and
        the offline torch hub (worker.agent.sandbox)."""
        if self.ctx.sandbox != sandbox.BWRAP:
            return None
        job = json.loads((self.run_dir / JOB_FILE).read_text(encoding="utf-8"))
        inputs = [job.get("train_dir"), job.get("val_dir"), job.get("init_from_dir")]
        read_only = [Path(p) for p in inputs if isinstance(p, str)]
        read_only.append(sandbox.torch_hub_dir(os.environ))
        return Sandbox(
            writable=self.run_dir, hidden=[self.ctx.work_dir], read_only=read_only, gpus=bool(self.gpu_ids)
        )

    def _outcome(
        self, spec: LaunchSpec, exit_code: int | None, agent_log: Path
    ) -> tuple[str, dict[str, Any] | None]:
        """``stopped``, ``preempted``, ``succeeded`` or ``failed`` (with the failure) once
        torchrun ended."""
        if self.stop_event.is_set():
            return "stopped", None
        if self.hang is not None:
            return "failed", self.hang
        if self.preempt_event.is_set():
            if not (self.run_dir / PREEMPTED_FILE).is_file():
                self.log.warning(
                    "the ranks did not finish their preemption checkpoint: the latest one counts"
                )
            return "preempted", None
        if exit_code == 0:
            # An evaluation's outcome is its result; it has no model directory of its own.
            uploads = self.node_rank == 0 and self.work.type == "train"
            failure = self.report.upload_model(self.run_dir) if uploads else None
            return ("failed", failure) if failure is not None else ("succeeded", None)
        failure = collect_failure(spec, exit_code, agent_log)
        self.log.error(
            "job %s failed: %s (rank %s on %s): %s",
            self.job_id,
            failure["code"],
            failure.get("rank"),
            failure.get("node"),
            failure["message"],
        )
        if failure.get("secondary") and self.work.node_count > 1:
            # Probably the echo of a failure elsewhere: give the node where it started
            # time to report it (or the API time to notice that node is gone).
            patience = self.ctx.lease_timeout_s + 2 * self.ctx.heartbeat_interval_s
            self.log.info("waiting up to %.0f s for the root cause to be reported elsewhere", patience)
            self.stop_event.wait(patience)
        return ("stopped", None) if self.stop_event.is_set() else ("failed", failure)

    def _start_reporter(self, spec: LaunchSpec, agent_log: Path) -> Any:
        return self._start_reporter_for(lambda: rank_log_files(spec), agent_log)

    def _start_reporter_for(
        self,
        log_sources: Callable[[], list[tuple[str, Path]]],
        agent_log: Path,
        metric_sources: Callable[[], list[Path]] | None = None,
        *,
        tracking_source: Callable[[], bytes | None] | None = None,
    ) -> Any:
        try:
            from worker.agent.reporting import RunReporter
        except ImportError:  # pragma: no cover - the reporting module ships with the agent
            self.log.warning("metrics and logs are not shipped: no reporting module")
            return None
        reporter = RunReporter(
            self.ctx.api.client,
            self.job_id,
            self.lease_token,
            self.run_dir,
            log_sources,
            agent_log,
            self.ctx.node_name,
            max_log_backlog=self.ctx.log_backlog_bytes,
            abandon=self.ctx.shutdown,
            metric_sources=metric_sources,
            tracking_source=tracking_source,
        )
        reporter.start()
        return reporter

    def _watch(self, group: RankGroup | ScriptGroup, reporter: Any) -> int | None:
        while True:
            code = group.wait(0.2)
            if code is not None:
                group.sweep()
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
