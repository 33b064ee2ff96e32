"""What a placement needs on disk before torchrun starts: datasets, an initial model, ``job.json``."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from torchyard.contract.errors import NotFoundError, RankFailedError, StaleLeaseError, TorchyardError
from torchyard.contract.failures import FailureReport
from torchyard.contract.jobfile import (
    JOB_FILE,
    DatasetRef,
    Datasets,
    JobConfig,
    ModelSpec,
    Parameters,
    TrainerTask,
)
from torchyard.contract.protocol import EvaluatePlacement, TrainPlacement
from worker.agent.api import retrying

if TYPE_CHECKING:
    from worker.agent.context import AgentContext
    from worker.agent.lease import LeaseSession

ROLES = ("train", "validation")
FETCH_DEADLINE_S = 600


class RunInputs:
    """Fetches one placement's inputs into the node's caches and writes its ``job.json``."""

    def __init__(
        self,
        ctx: AgentContext,
        work: TrainPlacement | EvaluatePlacement,
        run_dir: Path,
        stop: threading.Event,
        log: logging.Logger,
        *,
        session: LeaseSession,
        task: TrainerTask,
    ) -> None:
        self.ctx = ctx
        self.work = work
        self.run_dir = run_dir
        self.stop = stop
        self.log = log
        self.session = session
        self.task = task

    def prepare(self) -> JobConfig:
        """Datasets (cached per node), the initial model if any, then ``job.json`` (what it says)."""
        dirs = {role: self._fetch_dataset(role) for role in ROLES}
        init_dir = None
        if self.work.init_from_job:
            init_dir = self._fetch_init_model(self.work.init_from_job)
        weights_file = self._fetch_weights() if init_dir is None else None
        if self.work.checkpoint is not None and self.work.node_rank == 0:
            # Only global rank 0 (on node rank 0) reads it; it shares the state with the others.
            self._fetch_checkpoint()
        job = self._job_document(dirs, init_dir, weights_file)
        path = self.run_dir / JOB_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(job.to_json(), encoding="utf-8")
        tmp.replace(path)
        return job

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

    def _fetch_weights(self) -> Path | None:
        """A ``pretrained`` job's stored weights (cached per node), or the hub's default
        weights where this node may download them; None for the trainer's offline hub cache."""
        from worker.agent import weights_cache

        ref = getattr(self.work, "weights", None)
        if not self.work.spec.model.pretrained:
            return None
        if ref is None:
            if weights_cache.hub_allowed():
                arch = self.work.spec.model.architecture
                retrying(
                    lambda: weights_cache.fetch_hub_weights(arch),
                    f"downloading the default weights of {arch} from the model hub",
                    stop=self.stop,
                    deadline=time.monotonic() + FETCH_DEADLINE_S,
                )
            return None
        started = time.monotonic()
        path: Path = retrying(
            lambda: weights_cache.fetch_weights(self.ctx.api.client, ref, self.ctx.work_dir / "weights"),
            f"fetching weights {ref.id}",
            stop=self.stop,
            deadline=time.monotonic() + FETCH_DEADLINE_S,
        )
        self.log.info(
            "pretrained weights %s (%s, sha256 %s) ready in %.2f s",
            ref.id,
            ref.filename,
            ref.sha256,
            time.monotonic() - started,
        )
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
            stop=self.stop,
            deadline=time.monotonic() + FETCH_DEADLINE_S,
        )
        self.log.info("initial model of job %s fetched in %.2f s", source_job, time.monotonic() - started)
        return dest

    def _fetch_checkpoint(self) -> None:
        ref = self.work.checkpoint
        assert ref is not None
        started = time.monotonic()
        try:
            got = retrying(
                lambda: self.session.download_checkpoint(self.run_dir),
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

    def _job_document(
        self, dirs: dict[str, Path], init_dir: Path | None, weights_file: Path | None = None
    ) -> JobConfig:
        w = self.work
        model = w.spec.model
        return JobConfig(
            job_id=w.job_id,
            attempt_id=w.attempt_id,
            model=ModelSpec(
                architecture=model.architecture,
                pretrained=model.pretrained,
                memory_efficient=model.memory_efficient,
                weights_file=str(weights_file) if weights_file is not None else None,
            ),
            init_from_dir=str(init_dir) if init_dir is not None else None,
            parameters=Parameters.model_validate(w.spec.parameters.model_dump()),
            train_dir=str(dirs["train"]),
            val_dir=str(dirs["validation"]),
            classes=list(w.classes),
            datasets=Datasets(
                train=DatasetRef(id=w.datasets.train.id, sha256=w.datasets.train.sha256),
                validation=DatasetRef(id=w.datasets.validation.id, sha256=w.datasets.validation.sha256),
            ),
            output_dir=str(self.run_dir),
            loader_workers=None,
            task=self.task,
        )


def prepare_failure(exc: Exception, node_name: str, log: logging.Logger) -> FailureReport:
    """The failure to report when a node could not prepare its inputs."""
    if isinstance(exc, TorchyardError) and exc.code not in ("TorchyardError", StaleLeaseError.code):
        code, message = exc.code, exc.message
    else:
        code, message = RankFailedError.code, f"{type(exc).__name__}: {exc}"
    message = f"node {node_name} could not prepare the job: {message}"
    log.error("%s: %s", code, message)
    return FailureReport(code=code, message=message, node=node_name)
