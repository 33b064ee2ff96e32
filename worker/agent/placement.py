"""One claimed placement, from its datasets to its final status report, in a thread of its own.

Order matters at the end: the ranks have exited (or been stopped) → leftovers are
swept → node rank 0 uploads the model → the reporter ships the last metrics and log
lines → the final status goes out (the lease ends there, later writes would be 409).
"""

from __future__ import annotations

import json
import logging
import shlex
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torchyard.errors import (
    InvalidModelDirectoryError,
    RankFailedError,
    StaleLeaseError,
    TorchyardError,
    WorkerLostError,
)
from worker.agent.api import WorkerApi, retrying
from worker.agent.launcher import LaunchSpec, RankGroup, collect_failure, rank_log_files

log = logging.getLogger(__name__)

StopKind = Literal["cancelled", "attempt_ended", "stale", "shutdown"]
AGENT_LOG = "agent.log"
REPORTER_FLUSH_S = 30.0


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

    @property
    def dataset_cache(self) -> Path:
        return self.work_dir / "datasets"

    @property
    def runs_dir(self) -> Path:
        return self.work_dir / "runs"

    @property
    def models_dir(self) -> Path:
        return self.work_dir / "models"


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
    """A claimed placement: prepares, launches, watches, stops and reports its ranks."""

    def __init__(
        self,
        ctx: AgentContext,
        work: dict[str, Any],
        unit_ids: tuple[int, ...],
        *,
        gpu_ids: tuple[int, ...] = (),
    ) -> None:
        self.ctx = ctx
        self.work = work
        self.unit_ids = unit_ids
        self.gpu_ids = gpu_ids
        self.job_id: str = work["job_id"]
        self.lease_token: str = work["lease_token"]
        self.node_rank: int = work["node_rank"]
        self.units: int = work["process_count_per_node"]
        name = f"{self.job_id}-a{work['attempt_number']}-{ctx.node_name}"
        self.run_dir = ctx.runs_dir / name
        self.stop_event = threading.Event()
        self.stop_kind: StopKind | None = None
        self.stop_message = ""
        self.group: RankGroup | None = None
        self.final_state: str | None = None
        self.log = log
        self.thread = threading.Thread(target=self._main, name=f"run-{self.job_id[:8]}")

    def start(self) -> None:
        self.thread.start()

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
        self.log = runlog.logger
        try:
            self._run(runlog.path)
        except Exception as exc:
            self.log.exception("job %s: the agent failed running its placement", self.job_id)
            if self.group is not None:
                self.group.stop(self.ctx.grace_s)
            if self.final_state is None:
                message = f"the worker agent on node {self.ctx.node_name} failed: {type(exc).__name__}: {exc}"
                self._finish(
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
        w = self.work
        self.log.info(
            "job %s attempt %d: node rank %d of %d, %d process(es) per node, rendezvous %s:%d, run dir %s",
            self.job_id,
            w["attempt_number"],
            self.node_rank,
            w["node_count"],
            self.units,
            w["master_addr"],
            w["master_port"],
            self.run_dir,
        )
        try:
            job_file = self._prepare()
        except Exception as exc:
            if self.stop_event.is_set():
                self._finish_stopped(None)
            else:
                self._finish("failed", None, self._prepare_failure(exc))
            return
        if self.stop_event.is_set():
            self._finish_stopped(None)
            return

        spec = LaunchSpec(
            run_dir=self.run_dir,
            node_name=self.ctx.node_name,
            node_rank=self.node_rank,
            node_count=w["node_count"],
            nproc=self.units,
            master_addr=w["master_addr"],
            master_port=w["master_port"],
            cpus=self.ctx.cpus,
            gpu_ids=self.gpu_ids,
            socket_ifname=self.ctx.socket_ifname,
        )
        if spec.job_file != job_file:
            raise RuntimeError(f"job file {job_file} is not where torchrun will look ({spec.job_file})")
        group = self.group = RankGroup(spec)
        with open(agent_log, "a", encoding="utf-8") as out:
            pid = group.start(out)
        self.log.info("torchrun started (pid %d): %s", pid, shlex.join(group.command))
        reporter = self._start_reporter(spec, agent_log)
        self._report_running()

        exit_code = self._watch(group, reporter)
        self.log.info("torchrun ended: exit code %s", exit_code)

        outcome: tuple[str, dict[str, Any] | None]
        if self.stop_event.is_set():
            outcome = ("stopped", None)
        elif exit_code == 0:
            outcome = ("succeeded", None)
            if self.node_rank == 0:
                failure = self._upload_model()
                if failure is not None:
                    outcome = ("failed", failure)
        else:
            failure = collect_failure(spec, exit_code, agent_log)
            self.log.error(
                "job %s failed: %s (rank %s on %s): %s",
                self.job_id,
                failure["code"],
                failure.get("rank"),
                failure.get("node"),
                failure["message"],
            )
            if failure.get("secondary") and w["node_count"] > 1:
                # Probably the echo of a failure elsewhere: give the node where it started
                # time to report it (or the API time to notice that node is gone).
                patience = self.ctx.lease_timeout_s + 2 * self.ctx.heartbeat_interval_s
                self.log.info("waiting up to %.0f s for the root cause to be reported elsewhere", patience)
                self.stop_event.wait(patience)
            outcome = ("stopped", None) if self.stop_event.is_set() else ("failed", failure)

        if reporter is not None:
            reporter.stop(REPORTER_FLUSH_S)
        state, failure = outcome
        if state == "stopped":
            self._finish_stopped(exit_code)
        else:
            self._finish(state, exit_code, failure)

    # --- steps -----------------------------------------------------------------------------

    def _prepare(self) -> Path:
        """Datasets (cached per node), the initial model if any, then ``job.json``."""
        from worker.agent.dataset_cache import fetch_dataset

        w = self.work
        dirs: dict[str, Path] = {}
        for role in ("train", "validation"):
            ref: dict[str, Any] = w["datasets"][role]

            def fetch(ref: dict[str, Any] = ref) -> Path:
                return fetch_dataset(self.ctx.api.client, ref["id"], ref["sha256"], self.ctx.dataset_cache)

            started = time.monotonic()
            dirs[role] = retrying(
                fetch,
                f"fetching dataset {ref['id']}",
                stop=self.stop_event,
                deadline=time.monotonic() + 600,
            )
            self.log.info(
                "%s dataset %s ready in %.2f s: %s", role, ref["id"], time.monotonic() - started, dirs[role]
            )
        init_dir = None
        if w.get("init_from_job"):
            init_dir = self._fetch_init_model(w["init_from_job"])
        model = w["spec"]["model"]
        job = {
            "job_id": self.job_id,
            "attempt_id": w["attempt_id"],
            "model": {
                "architecture": model["architecture"],
                "pretrained": bool(model.get("pretrained", False)),
                "memory_efficient": bool(model.get("memory_efficient", False)),
            },
            "init_from_dir": str(init_dir) if init_dir is not None else None,
            "parameters": w["spec"]["parameters"],
            "train_dir": str(dirs["train"]),
            "val_dir": str(dirs["validation"]),
            "classes": list(w["classes"]),
            "datasets": {
                role: {"id": w["datasets"][role]["id"], "sha256": w["datasets"][role]["sha256"]}
                for role in ("train", "validation")
            },
            "output_dir": str(self.run_dir),
            "loader_workers": None,
        }
        path = self.run_dir / "job.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(job, indent=2), encoding="utf-8")
        tmp.replace(path)
        return path

    def _fetch_init_model(self, source_job: str) -> Path:
        from worker.agent.reporting import download_model

        dest = self.ctx.models_dir / source_job
        if dest.is_dir():
            self.log.info("initial model of job %s already on this node: %s", source_job, dest)
            return dest
        started = time.monotonic()
        retrying(
            lambda: download_model(self.ctx.api.client, source_job, dest),
            f"downloading the model of job {source_job}",
            stop=self.stop_event,
            deadline=time.monotonic() + 600,
        )
        self.log.info("initial model of job %s fetched in %.2f s", source_job, time.monotonic() - started)
        return dest

    def _prepare_failure(self, exc: Exception) -> dict[str, Any]:
        if isinstance(exc, TorchyardError) and exc.code not in ("TorchyardError", StaleLeaseError.code):
            code, message = exc.code, exc.message
        else:
            code, message = RankFailedError.code, f"{type(exc).__name__}: {exc}"
        message = f"node {self.ctx.node_name} could not prepare the job: {message}"
        self.log.error("%s: %s", code, message)
        return {"code": code, "message": message, "node": self.ctx.node_name}

    def _start_reporter(self, spec: LaunchSpec, agent_log: Path) -> Any:
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
            lambda: rank_log_files(spec),
            agent_log,
            self.ctx.node_name,
        )
        reporter.start()
        return reporter

    def _report_running(self) -> None:
        try:
            answer = retrying(
                lambda: self.ctx.api.report_status(self.lease_token, "running"),
                f"reporting job {self.job_id} running",
                stop=self.stop_event,
                deadline=time.monotonic() + self.ctx.lease_timeout_s,
            )
        except StaleLeaseError as exc:
            self.request_stop("stale", f"the lease is no longer valid: {exc.message}")
            return
        except Exception as exc:
            self.log.warning("could not report the ranks running (%s); the heartbeat keeps the lease", exc)
            return
        if answer.get("stop"):
            self.request_stop("cancelled", answer.get("reason") or "the API asked to stop")

    def _watch(self, group: RankGroup, reporter: Any) -> int | None:
        while True:
            code = group.wait(0.2)
            if code is not None:
                group.sweep()
                return code
            if reporter is not None and reporter.lease_lost:
                self.request_stop("stale", "the API refused the lease (409)")
            if self.stop_event.is_set():
                self.log.info(
                    "stopping the ranks (%s: %s): SIGTERM, SIGKILL after %.0f s",
                    self.stop_kind,
                    self.stop_message,
                    self.ctx.grace_s,
                )
                started = time.monotonic()
                code = group.stop(self.ctx.grace_s)
                self.log.info("ranks stopped in %.2f s", time.monotonic() - started)
                return code

    def _upload_model(self) -> dict[str, Any] | None:
        """Upload node rank 0's model directory; the failure to report if that went wrong."""
        from worker.agent.reporting import upload_model

        model_dir = self.run_dir / "model"
        if not model_dir.is_dir():
            return {
                "code": InvalidModelDirectoryError.code,
                "message": "training ended without writing its model directory",
                "rank": 0,
                "node": self.ctx.node_name,
            }
        started = time.monotonic()
        try:
            sha256 = upload_model(self.ctx.api.client, self.job_id, self.lease_token, model_dir)
        except StaleLeaseError as exc:
            self.request_stop("stale", exc.message)
            return None
        except Exception as exc:
            code = (
                exc.code
                if isinstance(exc, TorchyardError) and exc.status_code == 422
                else RankFailedError.code
            )
            message = exc.message if isinstance(exc, TorchyardError) else f"{type(exc).__name__}: {exc}"
            self.log.error("model upload failed: %s", message)
            return {
                "code": code,
                "message": f"model upload failed: {message}",
                "rank": 0,
                "node": self.ctx.node_name,
            }
        self.log.info("model uploaded in %.2f s (sha256 %s)", time.monotonic() - started, sha256)
        return None

    def _finish_stopped(self, exit_code: int | None) -> None:
        if self.stop_kind == "shutdown":
            message = f"the worker agent on node {self.ctx.node_name} was stopped"
            self._finish(
                "failed",
                exit_code,
                {"code": WorkerLostError.code, "message": message, "node": self.ctx.node_name},
            )
        else:
            self._finish("cancelled", exit_code, None)

    def _finish(self, state: str, exit_code: int | None, failure: dict[str, Any] | None) -> None:
        """The final status report; the lease ends with it."""
        self.final_state = state
        try:
            answer = retrying(
                lambda: self.ctx.api.report_status(
                    self.lease_token, state, exit_code=exit_code, failure=failure
                ),
                f"reporting job {self.job_id} {state}",
                deadline=time.monotonic() + max(60.0, 2 * self.ctx.lease_timeout_s),
            )
        except StaleLeaseError as exc:
            self.log.info("job %s: %s not recorded, the lease is gone (%s)", self.job_id, state, exc.message)
            return
        except Exception as exc:
            self.log.error("job %s: could not report %s: %s", self.job_id, state, exc)
            return
        self.log.info("job %s: reported %s; the job is %s", self.job_id, state, answer.get("job_status"))
