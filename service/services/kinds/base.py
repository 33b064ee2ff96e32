"""What every job kind answers on the service side (one module per kind beside this one).

A kind says what its submission checks and stores, what a claim of its placements
carries, when its attempt has succeeded, what a user sees of its spec and what it keeps
at the end (a model directory, an outputs folder, a result). The rest of the service asks
the job's kind (:func:`service.services.kinds.kind_of`), never ``if job.type == ...``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Attempt, Dataset, Job, JobEvent, Placement, Team
from service.db.types import utcnow
from service.services.teams import team_for_submission
from service.services.tokens import Principal
from service.states import JobStatus
from torchyard.contract.errors import RequestValidationError, TorchyardError
from torchyard.contract.jobspec import JobKind
from torchyard.contract.protocol import ClaimedDataset, ClaimedPlacement
from torchyard.contract.responses import StatusChange


@dataclass(frozen=True)
class Claim:
    """What a claim of one placement knows besides the job: its attempt, the placement,
    the fields every kind's claimed placement carries, and the settings."""

    attempt: Attempt
    placement: Placement
    common: dict[str, Any]
    settings: Settings


def claimed_dataset(session: Session, dataset_id: str) -> ClaimedDataset:
    row = session.get_one(Dataset, dataset_id)
    return ClaimedDataset(id=row.id, sha256=row.sha256, classes=list(row.classes), num_images=row.num_images)


# The message of a job's first status change.
SUBMITTED = "submitted"


def queue(
    session: Session,
    principal: Principal,
    kind: JobKind,
    request: Any,
    normalized: dict[str, Any],
    **columns: Any,
) -> Job:
    """Add a submitted job of ``kind``: its normalized spec, the priority and resources of its
    ``request`` (one process on one node without them) and the kind's own ``columns``; and
    its first status event (``queued``). The caller commits."""
    resources = getattr(request, "resources", None)
    node_count = resources.node_count if resources is not None else 1
    process_count_per_node = resources.process_count_per_node if resources is not None else 1
    now = utcnow()
    team_id = team_for_submission(session, principal, getattr(request, "team", None))
    if team_id is not None:
        normalized = {**normalized, "team": session.get_one(Team, team_id).name}
    job = Job(
        owner_id=principal.id,
        team_id=team_id,
        type=kind,
        name=normalized["name"],
        status=JobStatus.QUEUED,
        spec=normalized,
        node_count=node_count,
        process_count_per_node=process_count_per_node,
        priority=request.priority,
        created_at=now,
        updated_at=now,
        **columns,
    )
    session.add(job)
    session.flush()
    session.add(JobEvent(job_id=job.id, status=JobStatus.QUEUED, message=SUBMITTED, at=now))
    return job


def submitted_change(job: Job) -> StatusChange:
    """The status change :func:`queue` records for ``job`` (at its ``created_at``)."""
    return StatusChange(status=JobStatus.QUEUED, at=job.created_at, message=SUBMITTED)


class Kind(ABC):
    """One job kind's rules on the service side."""

    kind: ClassVar[JobKind]
    # The spec fields its JobPublic shows (besides name, resources and priority).
    shown_fields: ClassVar[tuple[str, ...]]
    # What its success message calls the work ("training finished on n1").
    work_name: ClassVar[str]
    # Node rank 0 uploads a model directory before it may report success (an ONNX export
    # and a model download come from it).
    keeps_model: ClassVar[bool] = False
    # The job keeps the output folder its nodes upload (PUT .../outputs).
    keeps_outputs: ClassVar[bool] = False

    @abstractmethod
    def submit(
        self, session: Session, settings: Settings, principal: Principal, spec: BaseModel, *, commit: bool
    ) -> Job:
        """Check a validated request of this kind against datasets, code, models and the
        cluster, then queue the job (``commit=False``: the caller commits)."""

    @abstractmethod
    def claimed(self, session: Session, job: Job, claim: Claim) -> ClaimedPlacement:
        """What the node that claimed one of the job's placements needs to launch it."""

    def shown(self, job: Job) -> dict[str, Any]:
        """The kind's own fields of its JobPublic."""
        spec: dict[str, Any] = job.spec
        return {k: v for k, v in spec.items() if k in self.shown_fields}

    def listed(self, job: Job) -> dict[str, Any]:
        """What a list of jobs shows of it besides the common columns."""
        return {}

    def uses_version(self, job: Job, version_id: str) -> bool:
        """Whether ``job`` needs the registered model version ``version_id`` while it runs."""
        return False

    def waits_for_every_node(self, job: Job) -> bool:
        """Whether the attempt succeeds only once every node reported success (else node
        rank 0's success ends it)."""
        return False

    def check_registration(self, job: Job, path: str | None) -> None:
        """Refuse registering the job's model as a version unless the kind has one there."""
        raise RequestValidationError(
            f"job {job.id} is a {job.type} job: only a training job's model directory, or a model "
            "directory in a script job's outputs, can be registered",
            details={"field": "job_id"},
        )

    def accepts_log_stream(self, stream: str, node_rank: int) -> bool:
        """A log stream other than the node's ranks and agent that its placements may ship."""
        return False

    def log_streams_hint(self, node_rank: int) -> str:
        """How the refusal of another stream names what :meth:`accepts_log_stream` allows."""
        return ""

    def check_tracking(self, job: Job) -> None:
        """Refuse MLflow run reports unless the kind makes them."""
        raise RequestValidationError("tracking: only script jobs report MLflow runs")

    def missing_result(self, job: Job) -> TorchyardError | None:
        """The error for ``GET /v1/jobs/{id}/result`` of a job that will never have one of
        its kind (None: the kind reports a result)."""
        return None

    def result_document(self, job: Job, result: dict[str, Any]) -> dict[str, Any]:
        """``GET /v1/jobs/{id}/result`` of a job with a result."""
        result = dict(result)
        result.pop("evaluation", None)
        return {"job_id": job.id, "type": job.type, "status": job.status, **result}
