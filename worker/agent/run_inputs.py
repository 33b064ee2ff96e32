"""What a placement needs on disk before torchrun starts: datasets, an initial model, ``job.json``."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchyard.contract.errors import NotFoundError, RankFailedError, StaleLeaseError, TorchyardError
from torchyard.contract.protocol import ClaimedPlacement
from worker.agent.api import retrying

if TYPE_CHECKING:
    from worker.agent.placement import AgentContext

ROLES = ("train", "validation")
FETCH_DEADLINE_S = 600


class RunInputs:
    """Fetches one placement's inputs into the node's caches and writes its ``job.json``."""

    def __init__(
        self,
        ctx: AgentContext,
        work: ClaimedPlacement,
        run_dir: Path,
        stop: threading.Event,
        log: logging.Logger,
    ) -> None:
        self.ctx = ctx
        self.work = work
        self.run_dir = run_dir
        self.stop = stop
        self.log = log

    def prepare(self) -> Path:
        """Datasets (cached per node), the initial model if any, then ``job.json``."""
        dirs = {role: self._fetch_dataset(role) for role in ROLES}
        init_dir = None
        if self.work.init_from_job:
            init_dir = self._fetch_init_model(self.work.init_from_job)
        if self.work.checkpoint is not None and self.work.node_rank == 0:
            # Only global rank 0 (on node rank 0) reads it; it shares the state with the others.
            self._fetch_checkpoint()
        path = self.run_dir / "job.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self._job_document(dirs, init_dir), indent=2), encoding="utf-8")
        tmp.replace(path)
        return path

    def _fetch_dataset(self, role: str) -> Path:
        from worker.agent.dataset_cache import fetch_dataset

        ref = getattr(self.work.datasets, role)
        started = time.monotonic()
        folder: Path = retrying(
            lambda: fetch_dataset(self.ctx.api.client, ref.id, ref.sha256, self.ctx.dataset_cache),
            f"fetching dataset {ref.id}",
            stop=self.stop,
            deadline=time.monotonic() + FETCH_DEADLINE_S,
        )
        self.log.info("%s dataset %s ready in %.2f s: %s", role, ref.id, time.monotonic() - started, folder)
        return folder

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
            stop=self.stop,
            deadline=time.monotonic() + FETCH_DEADLINE_S,
        )
        self.log.info("initial model of job %s fetched in %.2f s", source_job, time.monotonic() - started)
        return dest

    def _fetch_checkpoint(self) -> None:
        from worker.agent.checkpoints import download_checkpoint

        ref = self.work.checkpoint
        assert ref is not None
        started = time.monotonic()
        try:
            got = retrying(
                lambda: download_checkpoint(self.ctx.api.client, self.work.job_id, self.lease, self.run_dir),
                f"downloading the checkpoint of job {self.work.job_id}",
                stop=self.stop,
                deadline=time.monotonic() + FETCH_DEADLINE_S,
            )
        except NotFoundError:
            self.log.warning(
                "job %s: the API holds no readable checkpoint: starting from scratch", self.work.job_id
            )
            return
        self.log.info(
            "checkpoint of epoch %s%s fetched in %.2f s (%s bytes, sha256 %s): resuming from it",
            got.get("epoch"),
            f" step {got['step']}" if got.get("step") else "",
            time.monotonic() - started,
            got.get("size_bytes"),
            got.get("sha256"),
        )

    @property
    def lease(self) -> str:
        return self.work.lease_token

    def _job_document(self, dirs: dict[str, Path], init_dir: Path | None) -> dict[str, Any]:
        w = self.work
        model = w.spec["model"]
        return {
            "job_id": w.job_id,
            "attempt_id": w.attempt_id,
            "model": {
                "architecture": model["architecture"],
                "pretrained": bool(model.get("pretrained", False)),
                "memory_efficient": bool(model.get("memory_efficient", False)),
            },
            "init_from_dir": str(init_dir) if init_dir is not None else None,
            "parameters": w.spec["parameters"],
            "train_dir": str(dirs["train"]),
            "val_dir": str(dirs["validation"]),
            "classes": list(w.classes),
            "datasets": {
                role: {"id": getattr(w.datasets, role).id, "sha256": getattr(w.datasets, role).sha256}
                for role in ROLES
            },
            "output_dir": str(self.run_dir),
            "loader_workers": None,
            "task": "evaluate" if w.type == "evaluate" else "train",
        }


def prepare_failure(exc: Exception, node_name: str, log: logging.Logger) -> dict[str, Any]:
    """The failure to report when a node could not prepare its inputs."""
    if isinstance(exc, TorchyardError) and exc.code not in ("TorchyardError", StaleLeaseError.code):
        code, message = exc.code, exc.message
    else:
        code, message = RankFailedError.code, f"{type(exc).__name__}: {exc}"
    message = f"node {node_name} could not prepare the job: {message}"
    log.error("%s: %s", code, message)
    return {"code": code, "message": message, "node": node_name}
