"""Evaluation jobs (docs/models.md): a registered model scored on a labeled dataset, on a worker.

The job rides the training job's path through the scheduler and the agent: one process
on one node, the dataset fetched into the node's cache, the model directory downloaded
as for ``init_from_job`` (``init_from_job_id`` is the version's training job), and the
trainer program run in evaluation mode. Its result (top-1, top-5, loss, per-class
precision/recall/F1 and the confusion matrix) is the job's ``result``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Job
from service.schemas.jobs import EvaluateJobCreate
from service.services.cluster import check_resources
from service.services.datasets import dataset_field
from service.services.kinds.base import Claim, Kind, claimed_dataset, queue
from service.services.model_versions import get_version, parse_reference
from service.services.tokens import Principal
from torchyard.contract.errors import InvalidDatasetError, NotFoundError
from torchyard.contract.jobspec import JobKind
from torchyard.contract.protocol import ClaimedDatasets, EvaluatePlacement, EvaluateSpec


def _names(labels: list[str]) -> str:
    shown = ", ".join(repr(label) for label in labels[:10])
    return shown + (f" and {len(labels) - 10} more" if len(labels) > 10 else "")


def check_classes(model_classes: list[str], dataset_classes: list[str]) -> None:
    """The dataset's labels must be the model's, else ``InvalidDatasetError`` naming the difference."""
    missing = sorted(set(model_classes) - set(dataset_classes))
    extra = sorted(set(dataset_classes) - set(model_classes))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"labels of the model missing from the dataset: {_names(missing)}")
        if extra:
            parts.append(f"labels of the dataset the model does not know: {_names(extra)}")
        raise InvalidDatasetError(
            "the dataset's labels differ from the model's: " + "; ".join(parts),
            details={"field": "dataset", "missing": missing, "unexpected": extra},
        )


class Evaluate(Kind):
    kind: ClassVar[JobKind] = JobKind.EVALUATE
    shown_fields = ("model", "batch_size")
    work_name = "the evaluation"

    def submit(
        self, session: Session, settings: Settings, principal: Principal, spec: BaseModel, *, commit: bool
    ) -> Job:
        assert isinstance(spec, EvaluateJobCreate)
        name, version = parse_reference(spec.model)
        try:
            row = get_version(session, principal, name, version)
        except NotFoundError as exc:
            raise NotFoundError(exc.message, details={"field": "model"}) from exc
        dataset = dataset_field(session, principal, spec.dataset, "dataset")
        check_classes(list(row.classes), list(dataset.classes))
        check_resources(session, settings, 1, 1)
        normalized = spec.model_dump(mode="json")
        normalized["model"] = f"{row.name}:{row.version}"
        normalized["dataset"] = dataset.id
        normalized["name"] = spec.name or f"evaluate-{row.name}-{row.version}-{dataset.name}"
        normalized["resources"] = {"node_count": 1, "process_count_per_node": 1}
        normalized["model_version_id"] = row.id
        normalized["architecture"] = row.architecture
        normalized["classes"] = list(row.classes)
        normalized["image_size"] = row.image_size
        job = queue(
            session,
            principal,
            self.kind,
            spec,
            normalized,
            architecture=row.architecture,
            validation_dataset_id=dataset.id,
            init_from_job_id=row.job_id,
        )
        if commit:
            session.commit()
        return job

    def claimed(self, session: Session, job: Job, claim: Claim) -> EvaluatePlacement:
        assert job.validation_dataset_id is not None
        spec = job.spec
        evaluated = claimed_dataset(session, job.validation_dataset_id)
        return EvaluatePlacement(
            **claim.common,
            spec=EvaluateSpec.model_validate(
                {
                    "model": {"architecture": spec["architecture"]},
                    "parameters": {"image_size": spec["image_size"], "batch_size": spec["batch_size"]},
                    "resources": spec["resources"],
                }
            ),
            datasets=ClaimedDatasets(train=evaluated, validation=evaluated),
            classes=list(spec["classes"]),
            init_from_job=job.init_from_job_id,
        )

    def shown(self, job: Job) -> dict[str, Any]:
        return super().shown(job) | {"dataset": job.validation_dataset_id}

    def listed(self, job: Job) -> dict[str, Any]:
        return {"model": (job.spec or {}).get("model")}

    def uses_version(self, job: Job, version_id: str) -> bool:
        """An evaluation scores the version it names."""
        return bool(job.spec.get("model_version_id") == version_id)

    def result_document(self, job: Job, result: dict[str, Any]) -> dict[str, Any]:
        evaluation = result.get("evaluation")
        if not isinstance(evaluation, dict):
            return super().result_document(job, result)
        return {
            "job_id": job.id,
            "type": job.type,
            "status": job.status,
            "model": job.spec.get("model"),
            "dataset": job.validation_dataset_id,
            **evaluation,
        }
