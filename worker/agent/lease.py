"""One claimed placement's session with the API: every write under its lease."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from torchyard.contract.failures import FailureReport
from torchyard.contract.protocol import PlacementStatusResponse
from worker.agent.api import WorkerApi
from worker.agent.checkpoints import CheckpointUploader, download_checkpoint
from worker.agent.model_transfer import put_archive, upload_model
from worker.agent.reporting import RunReporter
from worker.agent.retry import Deadline


@dataclass(frozen=True)
class LeaseSession:
    """One placement's calls to the API: every write (status, model, outputs, checkpoints,
    metrics and logs) carries its lease, held here and nowhere else."""

    api: WorkerApi
    job_id: str
    lease_token: str

    @property
    def client(self) -> httpx.Client:
        return self.api.client

    def report_status(
        self, state: str, *, exit_code: int | None = None, failure: FailureReport | None = None
    ) -> PlacementStatusResponse:
        return self.api.report_status(self.lease_token, state, exit_code=exit_code, failure=failure)

    def upload_model(self, model_dir: Path, *, outage_deadline: Deadline | None = None) -> str:
        """Pack and upload node rank 0's model directory; its archive's sha256."""
        return upload_model(
            self.client, self.job_id, self.lease_token, model_dir, outage_deadline=outage_deadline
        )

    def download_checkpoint(self, run_dir: Path) -> dict[str, object]:
        """The job's latest checkpoint into ``run_dir`` (what it is: epoch, step, size, sha256)."""
        return download_checkpoint(self.client, self.job_id, self.lease_token, run_dir)

    def checkpoint_uploader(self, run_dir: Path, logger: logging.Logger) -> CheckpointUploader:
        """Uploads each new checkpoint of ``run_dir`` (node rank 0) under the lease."""
        return CheckpointUploader(self.client, self.job_id, self.lease_token, run_dir, logger)

    def reporter(
        self,
        run_dir: Path,
        log_sources: Callable[[], list[tuple[str, Path]]],
        agent_log: Path,
        node_name: str,
        *,
        max_log_backlog: int,
        abandon: Callable[[], bool],
        metric_sources: Callable[[], list[Path]] | None = None,
        tracking_source: Callable[[], bytes | None] | None = None,
    ) -> RunReporter:
        """Ships the run's metrics and log lines under the lease (not started)."""
        return RunReporter(
            self.client,
            self.job_id,
            self.lease_token,
            run_dir,
            log_sources,
            agent_log,
            node_name,
            max_log_backlog=max_log_backlog,
            abandon=abandon,
            metric_sources=metric_sources,
            tracking_source=tracking_source,
        )

    def upload_outputs(
        self,
        archive: Path,
        sha256: str,
        size: int,
        what: str,
        *,
        outage_deadline: Deadline | None = None,
    ) -> None:
        """Upload a packed outputs archive of this node under the lease: straight to the object
        store when the API's artifacts are there (docs/storage.md), else PUT to the API."""
        url = f"/v1/worker/jobs/{self.job_id}/outputs"
        put_archive(
            self.client,
            url,
            archive,
            sha256,
            size,
            self.lease_token,
            what,
            outage_deadline=outage_deadline,
            plan_url=f"{url}/upload",
        )
