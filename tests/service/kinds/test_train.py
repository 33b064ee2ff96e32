"""The training kind on the service side (service/services/kinds/train.py): what a submission
checks and stores, what a claim carries, what a user sees and what the kind keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import Checkpoint, Dataset, Job, JobEvent, Node
from service.schemas.jobs import TrainJobCreate
from service.services import checkpoints
from service.services.kinds.train import Train
from service.services.tokens import Principal
from service.states import JobStatus, Role
from tests.service.kinds.conftest import Rows
from torchyard.contract.errors import (
    InvalidDatasetError,
    InvalidModelDirectoryError,
    NotFoundError,
    RequestValidationError,
    ResourceLimitError,
)
from torchyard.contract.jobspec import JobKind
from torchyard.contract.protocol import CheckpointRef, ClaimedDataset, TrainPlacement

TRAIN = Train()


def _spec(train: str, val: str, **overrides: Any) -> TrainJobCreate:
    body: dict[str, Any] = {
        "model": {"architecture": "resnet18"},
        "train_dataset": train,
        "validation_dataset": val,
    }
    body.update(overrides)
    return TrainJobCreate.model_validate(body)


@pytest.fixture
def datasets(rows: Rows, alice: Principal, node: Node) -> tuple[str, str]:
    """Alice's training and validation datasets (same labels) on a cluster of one 4-unit node."""
    train = rows.dataset(alice, "flowers", ["rose", "tulip", "daisy"], sha="1")
    val = rows.dataset(alice, "flowers-val", ["daisy", "rose", "tulip"], sha="2")
    return train.id, val.id


def _submit(session: Session, rows: Rows, who: Principal, spec: TrainJobCreate) -> Job:
    return TRAIN.submit(session, rows.settings, who, spec, commit=False)


# --- submit: what it stores ----------------------------------------------------------------------


def test_submit_queues_the_normalized_spec_with_dataset_ids_and_columns(
    session: Session, rows: Rows, alice: Principal, datasets: tuple[str, str]
) -> None:
    train_id, val_id = datasets
    spec = _spec(
        "flowers",  # by name: stored as its id
        val_id,
        parameters={"epochs": 7},
        resources={"node_count": 1, "process_count_per_node": 3},
        priority=12,
    )
    job = _submit(session, rows, alice, spec)

    assert job.type == "train"
    assert job.status == JobStatus.QUEUED.value
    assert job.owner_id == alice.id
    assert job.name == "resnet18-flowers"  # architecture and the training dataset's name
    assert (job.architecture, job.train_dataset_id, job.validation_dataset_id) == (
        "resnet18",
        train_id,
        val_id,
    )
    assert job.init_from_job_id is None
    assert (job.node_count, job.process_count_per_node, job.priority) == (1, 3, 12)
    expected = spec.model_dump(mode="json") | {
        "train_dataset": train_id,
        "validation_dataset": val_id,
        "name": "resnet18-flowers",
    }
    assert job.spec == expected
    assert job.spec["parameters"]["epochs"] == 7
    events = session.scalars(select(JobEvent).where(JobEvent.job_id == job.id)).all()
    assert [(e.status, e.message) for e in events] == [("queued", "submitted")]


def test_a_given_name_is_kept(
    session: Session, rows: Rows, alice: Principal, datasets: tuple[str, str]
) -> None:
    job = _submit(session, rows, alice, _spec(*datasets, name="mine"))
    assert job.name == job.spec["name"] == "mine"


def test_commit_false_leaves_the_transaction_to_the_caller(
    session: Session, rows: Rows, alice: Principal, datasets: tuple[str, str]
) -> None:
    job_id = _submit(session, rows, alice, _spec(*datasets)).id
    session.rollback()
    assert session.get(Job, job_id) is None


def test_commit_true_commits(
    session: Session, rows: Rows, alice: Principal, datasets: tuple[str, str]
) -> None:
    job_id = TRAIN.submit(session, rows.settings, alice, _spec(*datasets), commit=True).id
    session.rollback()
    assert session.get(Job, job_id) is not None


# --- submit: what it refuses ---------------------------------------------------------------------


def test_an_unknown_architecture_names_the_closest(
    session: Session, rows: Rows, alice: Principal, datasets: tuple[str, str]
) -> None:
    with pytest.raises(InvalidModelDirectoryError) as err:
        _submit(session, rows, alice, _spec(*datasets, model={"architecture": "resnet19"}))
    assert err.value.status_code == 422
    assert err.value.message == "unknown architecture 'resnet19': did you mean resnet18?"
    assert err.value.details == {"field": "model.architecture", "value": "resnet19", "suggestion": "resnet18"}


def test_an_architecture_like_none_gets_examples_instead(
    session: Session, rows: Rows, alice: Principal, datasets: tuple[str, str]
) -> None:
    with pytest.raises(InvalidModelDirectoryError) as err:
        _submit(session, rows, alice, _spec(*datasets, model={"architecture": "qqqqqq"}))
    assert err.value.message == (
        "unknown architecture 'qqqqqq': use a torchvision classification model name such as "
        "resnet18, resnet50 or densenet121"
    )
    assert err.value.details == {"field": "model.architecture", "value": "qqqqqq"}


def test_memory_efficient_is_for_densenets_only(
    session: Session, rows: Rows, alice: Principal, datasets: tuple[str, str]
) -> None:
    with pytest.raises(InvalidModelDirectoryError) as err:
        _submit(
            session,
            rows,
            alice,
            _spec(*datasets, model={"architecture": "resnet18", "memory_efficient": True}),
        )
    assert err.value.message == "model.memory_efficient applies to DenseNet architectures only"
    assert err.value.details == {"field": "model.memory_efficient", "value": True}
    job = _submit(
        session,
        rows,
        alice,
        _spec(*datasets, model={"architecture": "densenet121", "memory_efficient": True}),
    )
    assert job.spec["model"]["memory_efficient"] is True


def test_init_from_job_is_kept_when_it_is_the_owners_succeeded_job_of_the_same_architecture(
    session: Session, rows: Rows, alice: Principal, datasets: tuple[str, str]
) -> None:
    source = rows.train_job(alice, session.get_one(Dataset, datasets[0]))
    job = _submit(
        session, rows, alice, _spec(*datasets, model={"architecture": "resnet18", "init_from_job": source.id})
    )
    assert job.init_from_job_id == source.id
    assert job.spec["model"]["init_from_job"] == source.id


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("unknown", "init_from_job 'no-such-job': no such job"),
        ("another user's", "init_from_job {id!r}: no such job"),
        ("running", "init_from_job {id!r} is running: only a succeeded job has a model directory"),
        ("densenet121", "init_from_job {id!r} trained densenet121, not resnet18"),
    ],
)
def test_init_from_job_refusals(
    session: Session,
    rows: Rows,
    alice: Principal,
    bob: Principal,
    datasets: tuple[str, str],
    case: str,
    message: str,
) -> None:
    train = session.get_one(Dataset, datasets[0])
    source_id = "no-such-job"
    if case == "another user's":
        source_id = rows.train_job(bob, train).id
    elif case == "running":
        source_id = rows.train_job(alice, train, status=JobStatus.RUNNING).id
    elif case == "densenet121":
        source_id = rows.train_job(alice, train, architecture="densenet121").id
    with pytest.raises(InvalidModelDirectoryError) as err:
        _submit(
            session,
            rows,
            alice,
            _spec(*datasets, model={"architecture": "resnet18", "init_from_job": source_id}),
        )
    assert err.value.status_code == 422
    assert err.value.message == message.format(id=source_id)


def test_an_admin_may_start_from_another_users_job(
    session: Session, rows: Rows, alice: Principal, bob: Principal, datasets: tuple[str, str]
) -> None:
    admin = rows.principal("root", Role.ADMIN)
    source = rows.train_job(bob, rows.dataset(bob, "bobs", ["a"]))
    job = _submit(
        session, rows, admin, _spec(*datasets, model={"architecture": "resnet18", "init_from_job": source.id})
    )
    assert job.init_from_job_id == source.id


def test_datasets_with_different_labels_are_refused_naming_both_sides(
    session: Session, rows: Rows, alice: Principal, node: Node
) -> None:
    train = rows.dataset(alice, "t", ["a", "b", "c"])
    val = rows.dataset(alice, "v", ["b", "c", "d"])
    with pytest.raises(InvalidDatasetError) as err:
        _submit(session, rows, alice, _spec(train.id, val.id))
    assert err.value.details == {"missing_in_validation": ["a"], "missing_in_training": ["d"]}


def test_another_users_dataset_is_not_found_naming_the_field(
    session: Session, rows: Rows, alice: Principal, bob: Principal, datasets: tuple[str, str]
) -> None:
    theirs = rows.dataset(bob, "theirs", ["daisy", "rose", "tulip"])
    with pytest.raises(NotFoundError) as err:
        _submit(session, rows, alice, _spec(datasets[0], theirs.id))
    assert err.value.status_code == 404
    assert err.value.message.startswith(f"validation_dataset: dataset {theirs.id!r} not found")
    assert err.value.details == {"field": "validation_dataset"}


def test_a_shape_beyond_the_cluster_is_refused_naming_field_value_and_limit(
    session: Session, rows: Rows, alice: Principal, datasets: tuple[str, str]
) -> None:
    with pytest.raises(ResourceLimitError) as err:
        _submit(
            session, rows, alice, _spec(*datasets, resources={"node_count": 2, "process_count_per_node": 5})
        )
    assert err.value.status_code == 422
    details = err.value.details
    assert isinstance(details, list)
    assert [(d["field"], d["value"], d["limit"]) for d in details] == [
        ("resources.node_count", 2, 1),  # the one node seen
        ("resources.process_count_per_node", 5, 4),  # its 4 units
    ]


# --- claim ---------------------------------------------------------------------------------------


def test_a_claim_carries_the_model_parameters_datasets_and_sorted_classes(
    session: Session, rows: Rows, alice: Principal, node: Node
) -> None:
    # The rows keep the classes in the order given here; the claim sorts them.
    train = rows.dataset(alice, "t", ["zebra", "ant", "moth"], per_class=5, sha="1")
    val = rows.dataset(alice, "v", ["moth", "zebra", "ant"], per_class=2, sha="2")
    job = _submit(
        session,
        rows,
        alice,
        _spec(
            train.id,
            val.id,
            parameters={"epochs": 3, "image_size": 32},
            resources={"process_count_per_node": 2},
        ),
    )
    claim = rows.claim(job, node)
    placed = TRAIN.claimed(session, job, claim)

    assert isinstance(placed, TrainPlacement)
    assert placed.type is JobKind.TRAIN
    assert placed.job_id == job.id and placed.attempt_id == claim.attempt.id
    assert placed.world_size == 2 and placed.master_port == 29511
    assert placed.spec.model.architecture == "resnet18"
    assert placed.spec.parameters.epochs == 3 and placed.spec.parameters.image_size == 32
    assert placed.spec.resources.process_count_per_node == 2
    assert placed.datasets.train == ClaimedDataset(
        id=train.id, sha256="1" * 64, classes=["zebra", "ant", "moth"], num_images=15
    )
    assert placed.datasets.validation == ClaimedDataset(
        id=val.id, sha256="2" * 64, classes=["moth", "zebra", "ant"], num_images=6
    )
    assert placed.classes == ["ant", "moth", "zebra"]
    assert placed.init_from_job is None
    assert placed.checkpoint is None


def test_a_claim_resumes_from_the_newest_checkpoint_whose_file_is_whole(
    session: Session, rows: Rows, alice: Principal, datasets: tuple[str, str], node: Node
) -> None:
    job = _submit(session, rows, alice, _spec(*datasets))
    claim = rows.claim(job, node)
    store = checkpoints.CheckpointStore(Path(rows.settings.data_dir))
    for epoch, size, written in ((1, 10, 10), (2, 20, 20), (3, 30, 7)):  # epoch 3's file is cut short
        row = Checkpoint(
            job_id=job.id,
            attempt_id=claim.attempt.id,
            attempt_number=1,
            epoch=epoch,
            sha256=str(epoch) * 64,
            size_bytes=size,
        )
        session.add(row)
        session.flush()
        path = store.path(job.id, row.id)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * written)
    placed = TRAIN.claimed(session, job, claim)
    assert placed.checkpoint == CheckpointRef(epoch=2, step=None, sha256="2" * 64, size_bytes=20, attempt=1)


# --- what a user sees, what is kept ------------------------------------------------------------------


def test_shown_is_the_model_parameters_and_dataset_ids(
    session: Session, rows: Rows, alice: Principal, datasets: tuple[str, str]
) -> None:
    job = _submit(session, rows, alice, _spec(*datasets, name="shown"))
    assert TRAIN.shown(job) == {
        "model": job.spec["model"],
        "parameters": job.spec["parameters"],
        "train_dataset": datasets[0],
        "validation_dataset": datasets[1],
    }
    assert TRAIN.listed(job) == {}


def test_what_a_training_job_keeps_and_reports(
    session: Session, rows: Rows, alice: Principal, datasets: tuple[str, str]
) -> None:
    job = _submit(session, rows, alice, _spec(*datasets))
    assert TRAIN.kind is JobKind.TRAIN
    assert TRAIN.keeps_model and not TRAIN.keeps_outputs
    assert TRAIN.work_name == "training"
    assert not TRAIN.waits_for_every_node(job)  # node rank 0's success ends the attempt
    assert not TRAIN.uses_version(job, "any")
    assert not TRAIN.accepts_log_stream("file-0/train.log", 0)
    assert TRAIN.missing_result(job) is None
    with pytest.raises(RequestValidationError) as err:
        TRAIN.check_tracking(job)
    assert err.value.message == "tracking: only script jobs report MLflow runs"
    result = {"best_epoch": 3, "evaluation": {"top1": 0.5}}
    assert TRAIN.result_document(job, result) == {
        "job_id": job.id,
        "type": "train",
        "status": "queued",
        "best_epoch": 3,
    }
    assert result == {"best_epoch": 3, "evaluation": {"top1": 0.5}}  # the stored result is left alone


def test_a_training_job_is_registered_without_path(
    session: Session, rows: Rows, alice: Principal, datasets: tuple[str, str]
) -> None:
    job = _submit(session, rows, alice, _spec(*datasets))
    TRAIN.check_registration(job, None)
    with pytest.raises(RequestValidationError) as err:
        TRAIN.check_registration(job, "model")
    assert err.value.status_code == 422
    assert err.value.details == {"field": "path"}
    assert "this job is a training job: register it without path" in err.value.message
