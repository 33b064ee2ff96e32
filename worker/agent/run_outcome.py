"""What a placement tells the API about itself: running, the model upload, the final status."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from torchyard.contract.errors import (
    InvalidModelDirectoryError,
    RankFailedError,
    StaleLeaseError,
    TorchyardError,
    WorkerLostError,
)
from torchyard.contract.failures import FailureReport
from worker.agent.api import retrying

if TYPE_CHECKING:
    from worker.agent.context import AgentContext
    from worker.agent.lease import LeaseSession

StopKind = Literal["cancelled", "attempt_ended", "stale", "shutdown", "preempted"]
RequestStop = Callable[[StopKind, str], None]
# A report (running, final status, the model) waits this long for an API that cannot be
# reached: an upgrade, a restart or a database outage must not cost a job.
OUTAGE_PATIENCE_S = 24 * 3600.0
# Once the agent is leaving, at least this long (two lease timeouts if longer).
LEAVING_PATIENCE_S = 60.0


class OutcomeReport:
    """Status reports of one placement under its lease; a refused lease asks the run to stop."""

    def __init__(
        self,
        ctx: AgentContext,
        session: LeaseSession,
        request_stop: RequestStop,
        log: logging.Logger,
    ) -> None:
        self.ctx = ctx
        self.session = session
        self.job_id = session.job_id
        self.request_stop = request_stop
        self.log = log
        self.final_state: str | None = None
        # True once the API recorded the final status: the run's results are stored there.
        self.recorded = False

    def outage_deadline(self) -> Callable[[], float]:
        """Until when (monotonic) a report or upload starting now waits out an unreachable
        API: while the agent runs, as long as an outage lasts (the ranks go on training
        meanwhile); once it is leaving (shut down, or draining after SIGTERM), a minute more
        (two lease timeouts if longer), however long the report had waited before. Asked
        again before each wait, so an agent told to go while a report waits does go."""
        start = time.monotonic()
        left_at: float | None = None

        def deadline() -> float:
            nonlocal left_at
            if not self.ctx.leaving():
                return start + OUTAGE_PATIENCE_S
            if left_at is None:
                left_at = time.monotonic()
            return min(
                start + OUTAGE_PATIENCE_S, left_at + max(LEAVING_PATIENCE_S, 2 * self.ctx.lease_timeout_s)
            )

        return deadline

    def report_running(self, stop: threading.Event) -> None:
        try:
            answer = retrying(
                lambda: self.session.report_status("running"),
                f"reporting job {self.job_id} running",
                stop=stop,
                deadline=self.outage_deadline(),
            )
        except StaleLeaseError as exc:
            self.request_stop("stale", f"the lease is no longer valid: {exc.message}")
            return
        except Exception as exc:
            self.log.warning("could not report the ranks running (%s); the heartbeat keeps the lease", exc)
            return
        if answer.stop:
            self.request_stop("cancelled", answer.reason or "the API asked to stop")

    def upload_model(self, run_dir: Path) -> FailureReport | None:
        """Upload node rank 0's model directory; the failure to report if that went wrong."""
        model_dir = run_dir / "model"
        if not model_dir.is_dir():
            return self._model_failure(
                InvalidModelDirectoryError.code, "training ended without writing its model directory"
            )
        started = time.monotonic()
        try:
            sha256 = self.session.upload_model(model_dir, outage_deadline=self.outage_deadline())
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
            return self._model_failure(code, f"model upload failed: {message}")
        self.log.info("model uploaded in %.2f s (sha256 %s)", time.monotonic() - started, sha256)
        return None

    def _model_failure(self, code: str, message: str) -> FailureReport:
        return FailureReport(code=code, message=message, rank=0, node=self.ctx.node_name)

    def finish_stopped(self, stop_kind: StopKind | None, exit_code: int | None) -> None:
        if stop_kind == "shutdown":
            message = f"the worker agent on node {self.ctx.node_name} was stopped"
            self.finish(
                "failed",
                exit_code,
                FailureReport(code=WorkerLostError.code, message=message, node=self.ctx.node_name),
            )
        else:
            self.finish("cancelled", exit_code, None)

    def finish(self, state: str, exit_code: int | None, failure: FailureReport | None) -> None:
        """The final status report; the lease ends with it."""
        self.final_state = state
        try:
            answer = retrying(
                lambda: self.session.report_status(state, exit_code=exit_code, failure=failure),
                f"reporting job {self.job_id} {state}",
                deadline=self.outage_deadline(),
            )
        except StaleLeaseError as exc:
            self.log.info("job %s: %s not recorded, the lease is gone (%s)", self.job_id, state, exc.message)
            return
        except Exception as exc:
            self.log.error("job %s: could not report %s: %s", self.job_id, state, exc)
            return
        self.recorded = True
        self.log.info("job %s: reported %s; the job is %s", self.job_id, state, answer.job_status)
