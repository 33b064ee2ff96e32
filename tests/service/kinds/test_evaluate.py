"""The evaluation kind on the service side (service/services/kinds/evaluate.py): a registered
model version scored on a labeled dataset. What a submission resolves and refuses, what a
claim carries, which versions it uses and what its result document says."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.orm import Session

from service.db.models import Job, Node
from service.schemas.jobs import EvaluateJobCreate
from service.services.kinds.evaluate import Evaluate, check_classes
from service.services.tokens import Principal
from service.states import JobStatus
from tests.service.kinds.conftest import Rows
from torchyard.contract.errors import (
    InvalidDatasetError,
    NotFoundError,
    RequestValidationError,
    ResourceLimitError,
)
from torchyard.contract.jobspec import JobKind
from torchyard.contract.protocol import ClaimedDataset, EvaluatePlacement

EVALUATE = Evaluate()
CLASSES = ["cat", "dog", "fox"]


def _spec(model: str, dataset: str, **overrides: Any) -> EvaluateJobCreate:
    body: dict[str, Any] = {"type": "evaluate", "model": model, "dataset": dataset}
    body.update(overrides)
    return EvaluateJobCreate.model_validate(body)


def _submit(session: Session, rows: Rows, who: Principal, spec: EvaluateJobCreate) -> Job:
    return EVALUATE.submit(session, rows.settings, who, spec, commit=False)


@pytest.fixture
def pets(rows: Rows, alice: Principal, node: Node) -> dict[str, Any]:
    """Alice's model ``pets`` in two versions (v2 the latest, another architecture and image
    size) trained by two jobs, and a labeled dataset ``zoo`` with the model's labels."""
    data = rows.dataset(alice, "zoo", ["fox", "cat", "dog"], per_class=5, sha="4")
    v1_job = rows.train_job(alice, data)
    v2_job = rows.train_job(alice, data, architecture="densenet121")
    return {
        "dataset": data,
        "v1": rows.version(alice, "pets", 1, v1_job, CLASSES, image_size=32),
        "v2": rows.version(alice, "pets", 2, v2_job, CLASSES, architecture="densenet121", image_size=48),
    }


# --- check_classes ---------------------------------------------------------------------------------


def test_labels_in_any_order_are_the_same() -> None:
    check_classes(["b", "a"], ["a", "b"])


def test_different_labels_name_both_sides() -> None:
    with pytest.raises(InvalidDatasetError) as err:
        check_classes(["a", "b", "c"], ["b", "c", "d", "e"])
    assert err.value.status_code == 422
    assert err.value.message == (
        "the dataset's labels differ from the model's: labels of the model missing from the dataset: 'a'; "
        "labels of the dataset the model does not know: 'd', 'e'"
    )
    assert err.value.details == {"field": "dataset", "missing": ["a"], "unexpected": ["d", "e"]}


def test_a_long_difference_shows_ten_labels_and_counts_the_rest() -> None:
    model = [f"c{i:02d}" for i in range(13)]
    with pytest.raises(InvalidDatasetError) as err:
        check_classes(model, [])
    shown = ", ".join(repr(c) for c in model[:10])
    assert err.value.message == (
        f"the dataset's labels differ from the model's: labels of the model missing from the dataset: {shown} and 3 more"
    )
    assert err.value.details is not None and err.value.details["missing"] == model  # all of them


# --- submit --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("reference", "version"), [("pets", "v2"), ("pets:latest", "v2"), ("pets:1", "v1")])
def test_submit_resolves_the_version_and_stores_what_the_node_needs(
    session: Session, rows: Rows, alice: Principal, pets: dict[str, Any], reference: str, version: str
) -> None:
    row = pets[version]
    data = pets["dataset"]
    spec = _spec(reference, "zoo", batch_size=8, priority=3)
    job = _submit(session, rows, alice, spec)

    assert job.type == JobKind.EVALUATE
    assert job.status == JobStatus.QUEUED
    assert job.name == f"evaluate-pets-{row.version}-zoo"
    assert (job.node_count, job.process_count_per_node, job.priority) == (1, 1, 3)
    assert job.architecture == row.architecture
    assert job.validation_dataset_id == data.id and job.train_dataset_id is None
    assert job.init_from_job_id == row.job_id  # the version's training job gives the model directory
    assert job.spec == spec.model_dump(mode="json") | {
        "model": f"pets:{row.version}",
        "dataset": data.id,
        "name": f"evaluate-pets-{row.version}-zoo",
        "resources": {"node_count": 1, "process_count_per_node": 1},
        "model_version_id": row.id,
        "architecture": row.architecture,
        "classes": CLASSES,
        "image_size": row.image_size,
    }


def test_a_given_name_is_kept(session: Session, rows: Rows, alice: Principal, pets: dict[str, Any]) -> None:
    assert _submit(session, rows, alice, _spec("pets", "zoo", name="check")).name == "check"


@pytest.mark.parametrize("reference", ["pets:3", "cats"])
def test_an_unknown_version_is_not_found_naming_the_model_field(
    session: Session, rows: Rows, alice: Principal, pets: dict[str, Any], reference: str
) -> None:
    with pytest.raises(NotFoundError) as err:
        _submit(session, rows, alice, _spec(reference, "zoo"))
    name, _, version = reference.partition(":")
    assert err.value.message == f"model version '{name}:{version or 'latest'}' not found"
    assert err.value.details == {"field": "model"}


def test_another_users_model_is_not_found(
    session: Session, rows: Rows, bob: Principal, pets: dict[str, Any]
) -> None:
    rows.dataset(bob, "zoo", CLASSES)
    with pytest.raises(NotFoundError) as err:
        _submit(session, rows, bob, _spec("pets", "zoo"))
    assert err.value.details == {"field": "model"}


def test_an_unknown_dataset_is_not_found_naming_the_dataset_field(
    session: Session, rows: Rows, alice: Principal, pets: dict[str, Any]
) -> None:
    with pytest.raises(NotFoundError) as err:
        _submit(session, rows, alice, _spec("pets", "nowhere"))
    assert err.value.message.startswith("dataset: dataset 'nowhere' not found")
    assert err.value.details == {"field": "dataset"}


def test_a_dataset_with_other_labels_is_refused(
    session: Session, rows: Rows, alice: Principal, pets: dict[str, Any]
) -> None:
    rows.dataset(alice, "farm", ["cat", "cow", "dog"])
    with pytest.raises(InvalidDatasetError) as err:
        _submit(session, rows, alice, _spec("pets", "farm"))
    assert err.value.details == {"field": "dataset", "missing": ["fox"], "unexpected": ["cow"]}


def test_an_evaluation_needs_one_ready_node(
    session: Session, rows: Rows, alice: Principal, pets: dict[str, Any], node: Node
) -> None:
    node.last_heartbeat_at = node.last_heartbeat_at.replace(year=2000)  # not seen for years
    session.flush()
    with pytest.raises(ResourceLimitError) as err:
        _submit(session, rows, alice, _spec("pets", "zoo"))
    assert [(d["field"], d["value"], d["limit"]) for d in err.value.details] == [
        ("resources.node_count", 1, 0),
        ("resources.process_count_per_node", 1, 0),
    ]


# --- claim, what a user sees ------------------------------------------------------------------------


def test_a_claim_scores_the_versions_model_on_the_dataset(
    session: Session, rows: Rows, alice: Principal, pets: dict[str, Any], node: Node
) -> None:
    row, data = pets["v2"], pets["dataset"]
    job = _submit(session, rows, alice, _spec("pets:2", "zoo", batch_size=8))
    placed = EVALUATE.claimed(session, job, rows.claim(job, node))

    assert isinstance(placed, EvaluatePlacement)
    assert placed.type is JobKind.EVALUATE
    assert placed.spec.model.architecture == "densenet121"
    assert (placed.spec.parameters.image_size, placed.spec.parameters.batch_size) == (48, 8)
    assert (placed.spec.resources.node_count, placed.spec.resources.process_count_per_node) == (1, 1)
    evaluated = ClaimedDataset(id=data.id, sha256="4" * 64, classes=["fox", "cat", "dog"], num_images=15)
    assert placed.datasets.train == evaluated and placed.datasets.validation == evaluated
    assert placed.classes == CLASSES  # the model's, in its order
    assert placed.init_from_job == row.job_id
    assert placed.checkpoint is None


def test_uses_version_shown_and_listed(
    session: Session, rows: Rows, alice: Principal, pets: dict[str, Any]
) -> None:
    job = _submit(session, rows, alice, _spec("pets:1", "zoo"))
    assert EVALUATE.uses_version(job, pets["v1"].id)
    assert not EVALUATE.uses_version(job, pets["v2"].id)
    assert EVALUATE.shown(job) == {"model": "pets:1", "batch_size": 64, "dataset": pets["dataset"].id}
    assert EVALUATE.listed(job) == {"model": "pets:1"}


def test_the_result_document_is_the_evaluation(
    session: Session, rows: Rows, alice: Principal, pets: dict[str, Any]
) -> None:
    job = _submit(session, rows, alice, _spec("pets:1", "zoo"))
    evaluation = {"top1": 0.75, "loss": 0.5, "confusion_matrix": [[1, 0], [0, 1]]}
    assert EVALUATE.result_document(job, {"evaluation": evaluation, "other": 1}) == {
        "job_id": job.id,
        "type": "evaluate",
        "status": "queued",
        "model": "pets:1",
        "dataset": pets["dataset"].id,
        **evaluation,
    }
    # A result without an evaluation is shown as any kind's.
    assert EVALUATE.result_document(job, {"other": 1}) == {
        "job_id": job.id,
        "type": "evaluate",
        "status": "queued",
        "other": 1,
    }


def test_an_evaluation_keeps_nothing_and_has_no_registration_or_tracking(
    session: Session, rows: Rows, alice: Principal, pets: dict[str, Any]
) -> None:
    job = _submit(session, rows, alice, _spec("pets:1", "zoo"))
    assert EVALUATE.kind is JobKind.EVALUATE
    assert not EVALUATE.keeps_model and not EVALUATE.keeps_outputs
    assert EVALUATE.work_name == "the evaluation"
    assert not EVALUATE.waits_for_every_node(job)
    assert EVALUATE.missing_result(job) is None
    with pytest.raises(RequestValidationError) as err:
        EVALUATE.check_registration(job, None)
    assert err.value.details == {"field": "job_id"}
    assert err.value.message.startswith(f"job {job.id} is a")
    assert err.value.message.endswith(
        "evaluate job: only a training job's model directory, or a model directory in a script job's "
        "outputs, can be registered"
    )
    with pytest.raises(RequestValidationError):
        EVALUATE.check_tracking(job)
