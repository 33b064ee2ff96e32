"""What every job kind shares on the service side (service/services/kinds/base.py): queueing a
submitted job, a claimed dataset, and the answers a kind gives unless it says otherwise."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.config import Settings
from service.db.models import Job, JobEvent
from service.services.kinds.base import SUBMITTED, Claim, Kind, claimed_dataset, queue, submitted_change
from service.services.tokens import Principal
from service.states import JobStatus
from tests.service.kinds.conftest import Rows
from torchyard.contract.errors import RequestValidationError
from torchyard.contract.jobspec import JobKind
from torchyard.contract.protocol import ClaimedDataset, ClaimedPlacement


class Bare(Kind):
    """A kind that overrides nothing it need not."""

    kind: ClassVar[JobKind] = JobKind.SCRIPT
    shown_fields = ("command", "outputs")
    work_name = "bare work"

    def submit(
        self, session: Session, settings: Settings, principal: Principal, spec: BaseModel, *, commit: bool
    ) -> Job:
        raise NotImplementedError

    def claimed(self, session: Session, job: Job, claim: Claim) -> ClaimedPlacement:
        raise NotImplementedError


class _Resources(BaseModel):
    node_count: int
    process_count_per_node: int


class _WithResources(BaseModel):
    priority: int
    resources: _Resources


class _WithoutResources(BaseModel):
    priority: int


def _queue(session: Session, who: Principal, request: BaseModel, **columns: Any) -> Job:
    normalized = {"name": "queued-job", "command": ["true"], "outputs": "node0", "secret": 1}
    return queue(session, who, JobKind.SCRIPT, request, normalized, **columns)


def test_queue_adds_the_job_with_the_requests_shape_and_its_first_event(
    session: Session, rows: Rows, alice: Principal
) -> None:
    code = rows.code(alice, "c")
    request = _WithResources(priority=9, resources=_Resources(node_count=3, process_count_per_node=2))
    job = _queue(session, alice, request, code_id=code.id)

    assert job.type == JobKind.SCRIPT and job.status == JobStatus.QUEUED
    assert (job.owner_id, job.name, job.code_id) == (alice.id, "queued-job", code.id)
    assert (job.node_count, job.process_count_per_node, job.priority) == (3, 2, 9)
    assert job.spec["name"] == "queued-job"
    assert job.created_at == job.updated_at
    events = session.scalars(select(JobEvent).where(JobEvent.job_id == job.id)).all()
    assert [(e.status, e.message, e.at) for e in events] == [("queued", SUBMITTED, job.created_at)]
    change = submitted_change(job)
    assert (change.status, change.message, change.at) == ("queued", "submitted", job.created_at)


def test_a_request_without_resources_is_one_process_on_one_node(
    session: Session, rows: Rows, alice: Principal
) -> None:
    job = _queue(session, alice, _WithoutResources(priority=-1), code_id=rows.code(alice, "c").id)
    assert (job.node_count, job.process_count_per_node, job.priority) == (1, 1, -1)


def test_claimed_dataset_is_what_a_node_needs_of_the_row(
    rows: Rows, session: Session, alice: Principal
) -> None:
    row = rows.dataset(alice, "d", ["x", "y"], per_class=6, sha="5")
    assert claimed_dataset(session, row.id) == ClaimedDataset(
        id=row.id, sha256="5" * 64, classes=["x", "y"], num_images=12
    )


def test_the_defaults_of_a_kind(session: Session, rows: Rows, alice: Principal) -> None:
    bare = Bare()
    job = _queue(session, alice, _WithoutResources(priority=0), code_id=rows.code(alice, "c").id)

    assert bare.shown(job) == {"command": ["true"], "outputs": "node0"}  # its shown fields only
    assert bare.listed(job) == {}
    assert not bare.keeps_model and not bare.keeps_outputs
    assert not bare.uses_version(job, "v")
    assert not bare.waits_for_every_node(job)
    assert not bare.accepts_log_stream("file-0/x.log", 0)
    assert bare.log_streams_hint(0) == ""
    assert bare.missing_result(job) is None
    with pytest.raises(RequestValidationError) as err:
        bare.check_registration(job, None)
    assert err.value.details == {"field": "job_id"}
    assert err.value.message == (
        f"job {job.id} is a script job: only a training job's model directory, or a model directory "
        "in a script job's outputs, can be registered"
    )
    with pytest.raises(RequestValidationError) as err:
        bare.check_tracking(job)
    assert err.value.message == "tracking: only script jobs report MLflow runs"


def test_the_default_result_document_leaves_the_evaluation_out(
    session: Session, rows: Rows, alice: Principal
) -> None:
    job = _queue(session, alice, _WithoutResources(priority=0), code_id=rows.code(alice, "c").id)
    result = {"evaluation": {"top1": 1.0}, "accuracy": 0.5}
    assert Bare().result_document(job, result) == {
        "job_id": job.id,
        "type": "script",
        "status": "queued",
        "accuracy": 0.5,
    }
    assert "evaluation" in result  # the stored result is left alone
