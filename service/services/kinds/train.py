"""Training jobs (docs/datasets.md): the built-in trainer on a training and a validation dataset.

Submission checks the architecture, ``init_from_job`` and both datasets; a claim carries
the model, parameters, datasets and the latest checkpoint; node rank 0's success (after its
model directory was uploaded) ends the attempt; the model directory is what is kept.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Job
from service.schemas.jobs import TrainJobCreate
from service.services import checkpoints, weights
from service.services.architectures import check_architecture
from service.services.cluster import check_resources
from service.services.datasets import resolve_job_datasets
from service.services.job_lookup import may_read
from service.services.kinds.base import Claim, Kind, claimed_dataset, queue
from service.services.tokens import Principal
from service.states import JobStatus
from torchyard.contract.errors import InvalidModelDirectoryError, RequestValidationError
from torchyard.contract.jobspec import JobKind
from torchyard.contract.protocol import ClaimedDatasets, TrainPlacement, TrainSpec


def check_model(session: Session, principal: Principal, spec: TrainJobCreate) -> None:
    arch = spec.model.architecture
    check_architecture(arch)
    if spec.model.memory_efficient and not arch.startswith("densenet"):
        raise InvalidModelDirectoryError(
            "model.memory_efficient applies to DenseNet architectures only",
            details={"field": "model.memory_efficient", "value": True},
        )
    if spec.model.pretrained and spec.model.init_from_job is None:
        weights.check_available(session, arch)
    if spec.model.init_from_job is not None:
        source = session.get(Job, spec.model.init_from_job)
        # Fine-tuning reads the source job, as a clone does: a teammate's job will do.
        if source is None or not may_read(principal, source.owner_id, source.team_id):
            raise InvalidModelDirectoryError(f"init_from_job {spec.model.init_from_job!r}: no such job")
        if source.status != JobStatus.SUCCEEDED:
            raise InvalidModelDirectoryError(
                f"init_from_job {source.id!r} is {source.status}: only a succeeded job has a model directory"
            )
        if source.architecture != arch:
            raise InvalidModelDirectoryError(
                f"init_from_job {source.id!r} trained {source.architecture}, not {arch}"
            )


class Train(Kind):
    kind: ClassVar[JobKind] = JobKind.TRAIN
    shown_fields = ("model", "parameters")
    work_name = "training"
    keeps_model = True

    def submit(
        self, session: Session, settings: Settings, principal: Principal, spec: BaseModel, *, commit: bool
    ) -> Job:
        """Validate a training spec against models, datasets and the cluster, then queue it."""
        assert isinstance(spec, TrainJobCreate)
        check_model(session, principal, spec)
        train, val = resolve_job_datasets(session, principal, spec.train_dataset, spec.validation_dataset)
        check_resources(session, settings, spec.resources.node_count, spec.resources.process_count_per_node)
        normalized = spec.model_dump(mode="json")
        normalized.update(train_dataset=train.id, validation_dataset=val.id)
        normalized["name"] = spec.name or f"{spec.model.architecture}-{train.name}"
        job = queue(
            session,
            principal,
            self.kind,
            spec,
            normalized,
            architecture=spec.model.architecture,
            train_dataset_id=train.id,
            validation_dataset_id=val.id,
            init_from_job_id=spec.model.init_from_job,
        )
        if commit:
            session.commit()
        return job

    def claimed(self, session: Session, job: Job, claim: Claim) -> TrainPlacement:
        assert job.train_dataset_id is not None and job.validation_dataset_id is not None
        spec = job.spec
        train = claimed_dataset(session, job.train_dataset_id)
        store = checkpoints.CheckpointStore.of(claim.settings)
        return TrainPlacement(
            **claim.common,
            spec=TrainSpec.model_validate(
                {"model": spec["model"], "parameters": spec["parameters"], "resources": spec["resources"]}
            ),
            datasets=ClaimedDatasets(
                train=train, validation=claimed_dataset(session, job.validation_dataset_id)
            ),
            classes=sorted(train.classes),
            init_from_job=job.init_from_job_id,
            checkpoint=checkpoints.latest_ref(session, store, job.id),
            weights=weights.claimed(session, spec["model"]) if job.init_from_job_id is None else None,
        )

    def shown(self, job: Job) -> dict[str, Any]:
        return super().shown(job) | {
            "train_dataset": job.train_dataset_id,
            "validation_dataset": job.validation_dataset_id,
        }

    def check_registration(self, job: Job, path: str | None) -> None:
        """A training job is registered without ``path``: its model directory is the job's."""
        if path is not None:
            raise RequestValidationError(
                "path (--path with torchyard model register) names a folder in a script job's outputs; "
                "this job is a training job: register it without path",
                details={"field": "path"},
            )
